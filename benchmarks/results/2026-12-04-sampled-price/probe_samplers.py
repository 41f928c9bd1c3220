"""What a sampled row's cycles cost against its own plain steps, per sampler, paired in one
process: for each sampler (greedy; T=0.7 top-p 1; T=0.7 top-p 0.95; the bench's t0.6: T=0.6
top-p 0.95 top-k 20), one scratch row's blocks as the calibration times them
(``step_timing._paired_ratios``: every depth's block between two plain blocks, order
rotating), an MTP row at depths (1, 2, 1, 4) and a scratch-lookup row at (1, 2, 4). The
samplers' order rotates every rep. Prints, per rep and sampler, the row's median plain step
(ms) and its cycles' ratios to it; then medians over reps.

    python probe_samplers.py [REPS] [ROUNDS]
"""

import mtplx  # noqa: F401
import os
import statistics
import sys
import time

from mtplx import step_timing
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.sampling import SamplerConfig

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
SAMPLERS = {
    "greedy": SamplerConfig(temperature=0.0),
    "t0.7 p1": SamplerConfig(temperature=0.7, seed=0),
    "t0.7 p0.95": SamplerConfig(temperature=0.7, top_p=0.95, seed=0),
    "t0.6 p0.95 k20": SamplerConfig(temperature=0.6, top_p=0.95, top_k=20, seed=0),
}
engine = Engine(load(ensure_default_model()))
print("load", os.getloadavg(), flush=True)


def measure(drafter, depths, sampler):
    rows = step_timing._scratch_rows(engine, 1, drafter, sampler)
    settle = step_timing.SETTLE_STEPS if drafter is None else step_timing.DRAFTING_SETTLE_STEPS
    try:
        return step_timing._paired_ratios(
            engine, rows, depths, ROUNDS, step_timing.DRAFTING_TIMED_STEPS, settle
        )
    finally:
        for row in rows:
            engine.abort(row)


out = {(name, kind): [] for name in SAMPLERS for kind in ("mtp", "lookup")}
names = list(SAMPLERS)
for rep in range(REPS):
    for name in names[rep % len(names):] + names[: rep % len(names)]:
        for kind, drafter, depths in (("mtp", "mtp", (1, 2, 1, 4)), ("lookup", None, (1, 2, 4))):
            started, cpu = time.perf_counter(), time.process_time()
            plain, ratios = measure(drafter, depths, SAMPLERS[name])
            out[(name, kind)].append((plain, ratios))
            print(
                f"rep {rep} {name:15s} {kind:6s} plain {plain * 1e3:6.2f} ms  "
                + "  ".join(f"d{k} {r:.3f}" for k, r in sorted(ratios.items()))
                + f"  ({time.perf_counter() - started:.1f} s, cpu {time.process_time() - cpu:.1f} s,"
                f" load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
print()
print("| sampler | row | plain step ms | depth 1 / plain | depth 2 / plain | depth 4 / plain |")
print("|---|---|---|---|---|---|")
for (name, kind), runs in out.items():
    plain = statistics.median(p for p, _ in runs)
    cells = [statistics.median(r[k] for _, r in runs) for k in (1, 2, 4)]
    print(f"| {name} | {kind} | {plain * 1e3:.2f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
print("load", os.getloadavg(), flush=True)
