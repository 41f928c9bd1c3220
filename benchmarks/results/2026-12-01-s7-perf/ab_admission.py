"""A/B of the admission step in ONE process: 7 decoding rows (1 token each, context ~100)
beside one prompt chunk of 32 tokens at a context of ``--context`` (a ~1,500-token prompt
being admitted), base checkout's SlotTarget against this checkout's, alternating; also a
whole 128-token prefill chunk alone at that context (the long prompt's own TTFT).

Usage: PYTHONPATH=<new checkout> python ab_admission.py --base /tmp/perf-base
"""

from __future__ import annotations

# ruff: noqa: I001  (mtplx must be imported before mlx: it loads the BLAS shim)

import argparse
import statistics
import time


import mtplx  # noqa: F401  (enables the BLAS shim before mlx)
import mlx.core as mx
from mtplx.models import load
from mtplx.models.batched import SlotTarget
from mtplx.models.gguf import ensure_default_model

from ab_forward import load_base  # same folder


def fill(target, row, length: int, seed: int) -> None:
    prompt = (mx.arange(length) * (7 + seed) % 1000).astype(mx.int32)
    for start in range(0, length, 128):
        mx.eval(target.forward([row], [prompt[start : start + 128]], "none")[0].hidden)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--context", type=int, default=1400)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model = load(ensure_default_model())
    kinds = {"base": load_base(args.base)(model.target, 16), "new": SlotTarget(model.target, 16)}
    state = {}
    for name, target in kinds.items():
        decoding = [target.new_row() for _ in range(7)]
        for i, row in enumerate(decoding):
            fill(target, row, 100 + 5 * i, i)
        long_row = target.new_row()
        fill(target, long_row, args.context, 99)
        state[name] = (decoding, long_row)
    results = {(k, case): [] for k in kinds for case in ("mixed", "chunk128")}
    for _ in range(args.repeats):
        for name, target in kinds.items():
            decoding, long_row = state[name]
            tokens = [mx.array([5 + i], mx.int32) for i in range(7)]
            chunk = (mx.arange(32) % 500).astype(mx.int32)
            t0 = time.perf_counter()
            out = target.forward([*decoding, long_row], [*tokens, chunk], ["all"] * 7 + ["none"])
            mx.eval([o.logits for o in out[:7]], out[7].hidden)
            results[(name, "mixed")].append(time.perf_counter() - t0)
            for row in decoding:
                target.trim(row, 1)
            target.trim(long_row, 32)
            chunk = (mx.arange(128) % 500).astype(mx.int32)
            t0 = time.perf_counter()
            mx.eval(target.forward([long_row], [chunk], "last")[0].logits)
            results[(name, "chunk128")].append(time.perf_counter() - t0)
            target.trim(long_row, 128)
    for (name, case), times in results.items():
        print(
            f"{case:9s} {name}: median {statistics.median(times) * 1e3:.0f} ms "
            f"[{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
