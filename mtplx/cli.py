"""The ``mtplx`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from mtplx import commands as run_commands
from mtplx.bench import cli as bench_commands
from mtplx.bench import prefix_bench
from mtplx.file_limits import import_mlx_lm


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
    parser = argparse.ArgumentParser(
        prog="mtplx",
        description="MTPLX: an OpenAI-compatible LLM server with exact speculative decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_commands.add_serve_parser(commands)
    run_commands.add_generate_parser(commands)
    bench_commands.add_bench_parser(commands)
    bench_commands.add_bench_serve_parser(commands)
    prefix_bench.add_parser(commands)
    inspect_parser = commands.add_parser(
        "inspect",
        help="describe a checkpoint: architecture, size, MTP heads, compatibility tier",
        description="Exit codes: 0 verified, 10 arch-compatible-unverified, 11 no-MTP, "
        "12 unsupported, 2 error.",
    )
    inspect_parser.add_argument("model", help="checkpoint directory or hub repo id")
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
    for name in ("serve", "generate", "bench", "inspect"):
        commands.choices[name].add_argument(
            "--weights",
            choices=("native", "f32"),
            help="how the CPU serves quantized weights: native (default: as stored, on the "
            "batch-invariant quantized kernel) or f32 (dequantized); sets MTPLX_WEIGHTS",
        )
        commands.choices[name].add_argument(
            "--activations",
            choices=("int8", "float32"),
            help="how the quantized kernel treats the rows it multiplies: int8 (default: rows "
            "quantized to 8 bits per group, integer dot products, as llama.cpp does) or float32 "
            "(the float product of the dequantized weights: slower, the f32 path's numbers); "
            "sets MTPLX_ACTIVATIONS",
        )
    args = parser.parse_args(argv)
    # Before anything imports mlx-lm, which would otherwise set the open-file limits itself.
    import_mlx_lm()
    if getattr(args, "weights", None):
        # Every load path (the default model's cache directory included) reads it from here.
        os.environ["MTPLX_WEIGHTS"] = args.weights
    if getattr(args, "activations", None):
        os.environ["MTPLX_ACTIVATIONS"] = args.activations
    if args.command == "convert-gguf":
        from mtplx.models.gguf import convert_gguf  # deferred: gguf/transformers load slowly

        print(convert_gguf(args.src, args.dst, dequantize=not args.keep_quantized))
        return 0
    if args.command == "serve":
        # The one import of the HTTP side from this package: the command line is where
        # the engine and the server are put together (tests/test_package.py allows it here).
        from server.main import serve

        return serve(args)
    if args.command == "generate":
        return run_commands.generate(args)
    if args.command == "bench":
        return bench_commands.bench(args, argv)
    if args.command == "bench-serve" and args.compare_plain:
        from mtplx.bench import serve_compare

        return serve_compare.main(args)
    if args.command == "bench-serve":
        from mtplx.bench import serve_bench

        return serve_bench.main(args)
    if args.command == "bench-prefix":
        return prefix_bench.main(args)
    if args.command == "inspect":
        return _inspect(args.model)
    return 0


def run() -> NoReturn:
    """The ``mtplx`` process (its console script, ``python -m mtplx``): ``main``, then exit.

    ``mtplx serve`` ends with ``os._exit`` once its output is flushed: by then the server has
    drained its requests and stopped its engine, and an interpreter shutdown would only tear
    down native threads (MLX's, the kernels' helpers, a model still loading on a daemon
    thread), which can abort a cleanly stopped server ("terminate called without an active
    exception", status -6)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] != ["serve"]:
        sys.exit(code)
    from mtplx.build_dirs import remove_stand_ins

    remove_stand_ins()  # atexit does not run past os._exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
