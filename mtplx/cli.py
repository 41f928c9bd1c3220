"""The ``mtplx`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mtplx`` command."""
    parser = argparse.ArgumentParser(prog="mtplx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the OpenAI-compatible server")
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(
            "mtplx serve: the HTTP server is not built yet (see the server issue); "
            "the sampling core is available as mtplx.sampling.",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
