"""One process's plain decoding and long-prompt first token on the default model, in CPU
time: run it once per code tree and mode, alternating, to compare them on a loaded machine.

Usage (from the tree to measure): PYTHONPATH=<tree> MTPLX_ACTIVATIONS=int8 python
benchmarks/results/2026-12-03-int8-lanes/decode_ab.py [--tokens 64] [--prompt-tokens 1500]
[--label NAME]. Prints one JSON line.
"""

# ruff: noqa: I001  (mtplx is imported first on purpose)
from __future__ import annotations

import mtplx  # noqa: F401  (first: the BLAS shim goes in before mlx loads)

import argparse
import importlib.util
import json
import os
from pathlib import Path

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "prefill_bench", HERE.parent / "2026-12-03-prefill-attention" / "prefill_bench.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model()))
    bench.first_token(engine, bench._prompt(engine, 99, 400))  # warm: traces, shapes
    bench.decode_step(engine, bench._prompt(engine, 98, 20), 4)
    row: dict[str, object] = {
        "label": args.label,
        "activations": os.environ.get("MTPLX_ACTIVATIONS", "float32"),
        "load": os.getloadavg()[0],
    }
    row.update(bench.decode_step(engine, bench._prompt(engine, 8, 30), args.tokens))
    row.update(bench.first_token(engine, bench._prompt(engine, 1, args.prompt_tokens)))
    row["load_after"] = os.getloadavg()[0]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
