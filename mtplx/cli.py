"""The ``mtplx`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mtplx`` command."""
    parser = argparse.ArgumentParser(prog="mtplx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the OpenAI-compatible server")
    convert = commands.add_parser(
        "convert-gguf", help="convert a llama GGUF file into an mlx-lm checkpoint directory"
    )
    convert.add_argument("src", type=Path, help="the .gguf file")
    convert.add_argument("dst", type=Path, help="output directory (replaced if it exists)")
    convert.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q4_0/Q4_1/Q8_0 tensors as (lossless) MLX 4/8-bit affine instead of float32",
    )
    args = parser.parse_args(argv)
    if args.command == "convert-gguf":
        from mtplx.models.gguf import convert_gguf  # deferred: gguf/transformers load slowly

        print(convert_gguf(args.src, args.dst, dequantize=not args.keep_quantized))
        return 0
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
