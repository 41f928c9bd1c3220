"""A/B of one packed decode forward (R rows, 1 token each, all logits) in ONE process:
the baseline checkout's SlotTarget (``--base``, its mtplx/models/batched.py loaded under
another name) against this checkout's, alternating, same weights. Wall and process CPU.

Usage: PYTHONPATH=<new checkout> python ab_forward.py --base /tmp/perf-base --rows 1,8,16
"""

from __future__ import annotations

# ruff: noqa: I001  (mtplx must be imported before mlx: it loads the BLAS shim)

import argparse
import importlib.util
import statistics
import sys
import time


import mtplx  # noqa: F401  (enables the BLAS shim before mlx)
import mlx.core as mx
from mtplx.models import load
from mtplx.models.batched import SlotTarget
from mtplx.models.gguf import ensure_default_model


def load_base(path: str):
    spec = importlib.util.spec_from_file_location("batched_base", f"{path}/mtplx/models/batched.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["batched_base"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.SlotTarget


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    model = load(ensure_default_model())
    kinds = {"base": load_base(args.base)(model.target, 16), "new": SlotTarget(model.target, 16)}
    for R in [int(r) for r in args.rows.split(",")]:
        rows = {}
        for name, target in kinds.items():
            rows[name] = [target.new_row() for _ in range(R)]
            for i, row in enumerate(rows[name]):
                prompt = (mx.arange(args.context + 3 * i) * 7 % 1000).astype(mx.int32)
                for start in range(0, prompt.shape[0], 128):  # the engine's largest chunk
                    chunk = prompt[start : start + 128]
                    mx.eval(target.forward([row], [chunk], "none")[0].hidden)
        wall = {k: [] for k in kinds}
        cpu = {k: [] for k in kinds}
        outs = {}
        for _ in range(args.repeats):
            for name, target in kinds.items():
                tokens = [mx.array([5 + i] * args.tokens, mx.int32) for i in range(R)]
                t0, c0 = time.perf_counter(), time.process_time()
                out = target.forward(rows[name], tokens, "all")
                mx.eval([o.logits for o in out])
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                outs[name] = out
                for row in rows[name]:
                    target.trim(row, args.tokens)
        same = all(
            mx.array_equal(a.logits, b.logits).item()
            for a, b in zip(outs["base"], outs["new"], strict=True)
        )
        line = [f"R={R}"]
        for name in kinds:
            w, c = wall[name], cpu[name]
            line.append(
                f"{name}: wall med {statistics.median(w) * 1e3:.1f} "
                f"[{min(w) * 1e3:.1f}-{max(w) * 1e3:.1f}] cpu med {statistics.median(c) * 1e3:.1f}"
            )
        ratio = statistics.median(wall["new"]) / statistics.median(wall["base"])
        line.append(f"new/base wall {ratio:.2f} bitwise-equal={same}")
        print(" | ".join(line), flush=True)
        for name, target in kinds.items():
            for row in rows[name]:
                target.release(row)


if __name__ == "__main__":
    main()
