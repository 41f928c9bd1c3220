"""The ``mtplx`` command line."""

from __future__ import annotations

import argparse
import sys


def _inspect(model: str) -> int:
    """``mtplx inspect MODEL``: print the report; the exit code is the tier's."""
    from mtplx.models import EXIT_ERROR, inspect

    try:
        report = inspect(model)
    except (OSError, ValueError) as error:
        print(f"mtplx inspect: {error}", file=sys.stderr)
        return EXIT_ERROR
    print(report.render())
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mtplx`` command."""
    parser = argparse.ArgumentParser(prog="mtplx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the OpenAI-compatible server")
    inspect_parser = commands.add_parser(
        "inspect",
        help="describe a checkpoint: architecture, size, MTP heads, compatibility tier",
        description="Exit codes: 0 verified, 10 arch-compatible-unverified, 11 no-MTP, "
        "12 unsupported, 2 error.",
    )
    inspect_parser.add_argument("model", help="checkpoint directory or hub repo id")
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(
            "mtplx serve: the HTTP server is not built yet (see the server issue); "
            "the sampling core is available as mtplx.sampling.",
            file=sys.stderr,
        )
        return 2
    if args.command == "inspect":
        return _inspect(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
