"""The ``mtplx`` command line."""

from __future__ import annotations

import argparse
import sys

from mtplx import serve as serve_commands


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mtplx`` command."""
    parser = argparse.ArgumentParser(prog="mtplx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_commands.add_serve_parser(commands)
    serve_commands.add_generate_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_commands.serve(args)
    if args.command == "generate":
        return serve_commands.generate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
