"""The start-up calibration before this change (``BEFORE``'s ``mtplx/step_timing.py``,
greedy cycles only) and after it, against the cycles themselves, in one process, turn about
(the order rotating every rep): each calibration's modelled cost(1) / cost(0) of a depth-1
MTP cycle at batch 1 per sampling kind (greedy; sampled; filtered), its wall and
process-CPU seconds; and per kind the cycle's ratio as ``benchmarks/cycle_ab.py`` measures
it (PAIRS pairs of whole 64-token chat requests, plain and mtp@1, the order alternating;
the median of the paired ratios of median steps). Kinds: greedy (T=0), sampled (T=0.6,
top-p 1: cycle_ab's ``--temperature 0.6``), filtered (the bench's t0.6: T=0.6, top-p 0.95,
top-k 20). Before prices every kind as greedy.

    python calib_vs_cycle.py REPS [PAIRS] [BEFORE]
"""

import mtplx  # noqa: F401
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import cycle_ab  # noqa: E402
from mtplx import step_timing  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.planner import FILTERED, GREEDY, SAMPLED  # noqa: E402

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
PAIRS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
BEFORE = sys.argv[3] if len(sys.argv) > 3 else "861d0bb"
KINDS = {GREEDY: (0.0, 1.0, 0), SAMPLED: (0.6, 1.0, 0), FILTERED: (0.6, 0.95, 20)}
old = cycle_ab.old_module(BEFORE, "mtplx/step_timing.py")
engine = Engine(load(ensure_default_model()))
print("load", os.getloadavg(), "before", BEFORE, flush=True)
price = {(code, kind): [] for code in ("old", "new") for kind in KINDS}
measured = {kind: [] for kind in KINDS}
took = {"old": [], "new": []}


def calib(code):
    module = old if code == "old" else step_timing
    started, cpu = time.perf_counter(), time.process_time()
    costs = engine.priced(module.calibrate(engine))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    ratios = {}
    for kind in KINDS:
        row = costs.row_costs("mtp", 1, 2, kind) if code == "new" else costs.row_costs("mtp", 1, 2)
        ratios[kind] = row[1] / row[0]
    lookup = costs.row_costs("ngram", 1, 1, SAMPLED if code == "new" else GREEDY)
    return ratios, wall, cpu, costs, lookup[1] / lookup[0]


def cycles(kind):
    temperature, top_p, top_k = KINDS[kind]
    pairs = []
    for p in range(PAIRS):
        got = {}
        for name, depth in (("none", 0), ("mtp", 1)) if p % 2 == 0 else (("mtp", 1), ("none", 0)):
            got[name] = cycle_ab.run(engine, name, depth, 64, temperature, top_p, top_k)[0]
        pairs.append(got["mtp"] / got["none"])
    return statistics.median(pairs), pairs


names = ["old", "new", *(f"cycle {k}" for k in KINDS)]
for rep in range(REPS):
    line = [f"rep {rep}:"]
    for name in names[rep % len(names) :] + names[: rep % len(names)]:
        if name.startswith("cycle"):
            kind = name.split()[1]
            ratio, pairs = cycles(kind)
            measured[kind].append(ratio)
            line.append(f"{name} {ratio:.3f} {[round(x, 3) for x in pairs]}")
        else:
            ratios, wall, cpu, costs, lookup = calib(name)
            for kind, r in ratios.items():
                price[(name, kind)].append(r)
            took[name].append((wall, cpu))
            line.append(
                f"{name} " + " ".join(f"{k} {r:.3f}" for k, r in ratios.items())
                + f" lookup@1 sampled {lookup:.3f} (plain {costs.plain[0] * 1e3:.2f} ms,"
                f" {wall:.1f} s, cpu {cpu:.1f} s)"
            )
    line.append(f"load {os.getloadavg()[0]:.2f}")
    print(" | ".join(line), flush=True)
print()
print("| kind | old price | new price | cycles measured | old / measured | new / measured |")
print("|---|---|---|---|---|---|")
for kind in KINDS:
    o, n, m = price[("old", kind)], price[("new", kind)], measured[kind]
    po = statistics.median(a / b for a, b in zip(o, m))
    pn = statistics.median(a / b for a, b in zip(n, m))
    print(
        f"| {kind} | {statistics.median(o):.3f} | {statistics.median(n):.3f} | "
        f"{statistics.median(m):.3f} | {po:.3f} | {pn:.3f} |"
    )
for code in ("old", "new"):
    walls = [round(w, 1) for w, _ in took[code]]
    cpus = [round(c, 1) for _, c in took[code]]
    print(f"{code} calibration wall s {walls} (median {statistics.median(w for w, _ in took[code]):.1f}), "
          f"cpu s {cpus} (median {statistics.median(c for _, c in took[code]):.1f})")
print("load", os.getloadavg(), flush=True)
