"""The calibration's price of a depth-1 MTP cycle against what the cycle costs, in one
process, turn about: per repetition one whole calibration (``calibrate``: its modelled
cost(1) / cost(0) for MTP at batch 1, and what ``time_steps`` / ``time_drafting`` returned at
batch 1) and then PAIRS pairs of whole greedy requests as ``benchmarks/cycle_ab.py`` runs
them (plain, mtp@1; the order alternating; median step of each request, paired ratio).

    python calib_vs_cycle.py REPS [PAIRS]
"""
import mtplx  # noqa: F401
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import cycle_ab  # noqa: E402
from mtplx import calibration  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
PAIRS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
engine = Engine(load(ensure_default_model()))

seen = {}
for name in ("time_steps", "time_drafting"):
    original = getattr(calibration, name)

    def wrapped(*args, _original=original, _name=name, **kwargs):
        out = _original(*args, **kwargs)
        if _name == "time_drafting" or args[1] == 1:
            seen[_name] = out
        return out

    setattr(calibration, name, wrapped)

print("load", os.getloadavg(), flush=True)
model_ratios, cycle_ratios = [], []
for rep in range(REPS):
    started, cpu = time.perf_counter(), time.process_time()
    costs = engine.priced(calibration.calibrate(engine))
    took, took_cpu = time.perf_counter() - started, time.process_time() - cpu
    row = costs.row_costs("mtp", 1, 2)
    model = row[1] / row[0]
    pairs = []
    for p in range(PAIRS):
        got = {}
        for kind in (("none", 0), ("mtp", 1)) if p % 2 == 0 else (("mtp", 1), ("none", 0)):
            got[kind[0]] = cycle_ab.run(engine, kind[0], kind[1], 64)[0]
        pairs.append(got["mtp"] / got["none"])
    cycle = statistics.median(pairs)
    model_ratios.append(model)
    cycle_ratios.append(cycle)
    fmt = lambda d: {k: round(v * 1e3, 2) for k, v in d.items()}  # noqa: E731
    print(
        f"rep {rep}: calibration {took:.1f} s (cpu {took_cpu:.1f}); model plain {row[0]*1e3:.2f} "
        f"mtp@1 {row[1]*1e3:.2f} ratio {model:.3f} | cycles: ratio {cycle:.3f} "
        f"(pairs {[round(x, 3) for x in pairs]}) | load {os.getloadavg()[0]:.2f}\n"
        f"   steps(B=1) {fmt(seen.get('time_steps', {}))} drafting {fmt(seen.get('time_drafting', {}))} "
        f"mtp row {[round(x * 1e3, 2) for x in costs.drafting['mtp']]} per_token {costs.per_token[0]*1e3:.2f} sync {costs.sync[0]*1e3:.2f}",
        flush=True,
    )
print(f"model ratios {[round(x, 3) for x in model_ratios]} median {statistics.median(model_ratios):.3f}")
print(f"cycle ratios {[round(x, 3) for x in cycle_ratios]} median {statistics.median(cycle_ratios):.3f}")
print(f"model/cycle per rep {[round(m / c, 3) for m, c in zip(model_ratios, cycle_ratios)]}")
print("load", os.getloadavg(), flush=True)
