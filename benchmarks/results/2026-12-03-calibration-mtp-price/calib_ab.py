"""The old calibration (``--before``'s ``mtplx/calibration.py``) against the working tree's,
against the cycles themselves, in one process, turn about (the order rotating every rep):
each calibration's modelled cost(1) / cost(0) for a depth-1 MTP cycle at batch 1, and the
cycle's ratio as ``benchmarks/cycle_ab.py`` measures it (PAIRS pairs of whole greedy chat
requests, plain and mtp@1, the order alternating; the median of the paired ratios). Also
each calibration's wall and process-CPU seconds.

    python calib_ab.py REPS [PAIRS] [BEFORE]
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
BEFORE = sys.argv[3] if len(sys.argv) > 3 else "HEAD"
old = cycle_ab.old_module(BEFORE, "mtplx/calibration.py")
engine = Engine(load(ensure_default_model()))
print("load", os.getloadavg(), "before", BEFORE, flush=True)
out = {"old": [], "new": [], "cycle": []}
took = {"old": [], "new": []}


def calib(module):
    started, cpu = time.perf_counter(), time.process_time()
    costs = engine.priced(module.calibrate(engine))
    row = costs.row_costs("mtp", 1, 2)
    return row[1] / row[0], time.perf_counter() - started, time.process_time() - cpu, costs


def cycles():
    pairs = []
    for p in range(PAIRS):
        got = {}
        for kind in (("none", 0), ("mtp", 1)) if p % 2 == 0 else (("mtp", 1), ("none", 0)):
            got[kind[0]] = cycle_ab.run(engine, kind[0], kind[1], 64)[0]
        pairs.append(got["mtp"] / got["none"])
    return statistics.median(pairs), pairs


names = ["old", "new", "cycle"]
for rep in range(REPS):
    line = [f"rep {rep}:"]
    for name in names[rep % 3:] + names[: rep % 3]:
        if name == "cycle":
            ratio, pairs = cycles()
            out["cycle"].append(ratio)
            line.append(f"cycle {ratio:.3f} {[round(x, 3) for x in pairs]}")
        else:
            ratio, wall, cpu, costs = calib(old if name == "old" else calibration)
            out[name].append(ratio)
            took[name].append((wall, cpu))
            line.append(
                f"{name} {ratio:.3f} (plain {costs.plain[0]*1e3:.2f} ms, {wall:.1f} s, cpu {cpu:.1f} s, "
                f"mtp {[round(x * 1e3, 2) for x in costs.drafting['mtp'][:3]]}, per_token {costs.per_token[0]*1e3:.2f})"
            )
    line.append(f"load {os.getloadavg()[0]:.2f}")
    print(" | ".join(line), flush=True)
for name in names:
    print(f"{name}: {[round(x, 3) for x in out[name]]} median {statistics.median(out[name]):.3f}")
for name in ("old", "new"):
    per = [m / c for m, c in zip(out[name], out["cycle"])]
    print(f"{name} / cycle per rep: {[round(x, 3) for x in per]} median {statistics.median(per):.3f}")
    print(f"{name} calibration wall s {[round(w, 1) for w, _ in took[name]]} cpu s {[round(c, 1) for _, c in took[name]]}")
print("load", os.getloadavg(), flush=True)
