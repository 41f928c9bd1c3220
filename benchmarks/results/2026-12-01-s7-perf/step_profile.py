"""Where an engine step's time goes, in process: the packed forward (trunk, attention, LM
head), sampling, graph building, syncs, the engine's bookkeeping.

Usage: PYTHONPATH=<checkout> python step_profile.py --rows 1,8,16 [--repeats 7]
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
from mtplx.sampling import SamplerConfig, mx_distribution_from_logits, mx_sample
from mtplx.speculative import cycle_uniforms


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=100)
    args = parser.parse_args()
    model = load(ensure_default_model())
    target = SlotTarget(model.target, 16)
    cfg = SamplerConfig(temperature=0.7, seed=1)
    greedy = SamplerConfig(temperature=0.0)
    for R in [int(x) for x in args.rows.split(",")]:
        rows = [target.new_row() for _ in range(R)]
        # a context of `context` tokens per row
        for row in rows:
            out = target.forward([row], [mx.arange(args.context).astype(mx.int32) % 1000], "none")
            mx.eval(out[0].hidden)
        report = {}

        def forward_full():
            outs = target.forward(rows, [mx.array([5], mx.int32) for _ in rows], "all")
            mx.eval([(o.logits, o.hidden) for o in outs])
            for row in rows:
                target.trim(row, 1)

        def forward_build():
            outs = target.forward(rows, [mx.array([5], mx.int32) for _ in rows], "all")
            for row in rows:
                target.trim(row, 1)
            return outs

        def forward_nohead():
            outs = target.forward(rows, [mx.array([5], mx.int32) for _ in rows], "none")
            mx.eval([o.hidden for o in outs])
            for row in rows:
                target.trim(row, 1)

        hidden = mx.random.normal((R, target.hidden_size))
        mx.eval(hidden)

        def head_only():
            mx.eval(target.trunk.lm_head(hidden[None]))

        logits = target.trunk.lm_head(hidden[None])[0]
        mx.eval(logits)

        def sample_rows(config):
            def go():
                toks = []
                for r in range(R):
                    probs = mx_distribution_from_logits(logits[r : r + 1], config)
                    toks.append(mx_sample(probs, cycle_uniforms(7, 100 + r, 0)))
                mx.eval(toks)
                [int(t.item()) for t in toks]

            return go

        def uniforms_only():
            for r in range(R):
                cycle_uniforms(7, 100 + r, 0)

        report["forward+eval (all logits)"] = timed(forward_full, args.repeats)
        report["forward+eval (no head)"] = timed(forward_nohead, args.repeats)
        report["graph build only"] = timed(forward_build, args.repeats)
        report["lm head alone"] = timed(head_only, args.repeats)
        report["sampling T=0.7 per row"] = timed(sample_rows(cfg), args.repeats)
        report["sampling greedy per row"] = timed(sample_rows(greedy), args.repeats)
        report["cycle_uniforms per row"] = timed(uniforms_only, args.repeats)
        print(f"--- rows={R} context={args.context}")
        for k, (mn, md) in report.items():
            print(f"  {k:32s} min {mn * 1e3:7.1f} ms  median {md * 1e3:7.1f} ms")
        for row in rows:
            target.release(row)


if __name__ == "__main__":
    main()
