"""One row alone, alternating: scratch lookup depth 1, mtp depth 1 (same scratch prompt), plain."""
import statistics, time
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx import calibration
engine = Engine(load(ensure_default_model()))
res = {}
def timed(drafter, depth, steps=12):
    (row,) = calibration._scratch_rows(engine, 1, drafter)
    row.depth = depth
    for _ in range(3): engine.step()
    ts = []
    engine.time_drafts = True
    dts = []
    for _ in range(steps):
        t = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t); dts.append(engine.last_draft_seconds)
    engine.time_drafts = False
    engine.abort(row)
    return statistics.median(ts), statistics.median(dts)
for rnd in range(4):
    for name, drafter, depth in (("plain", None, 0), ("lookup1", None, 1), ("mtp1", "mtp", 1), ("lookup2", None, 2), ("mtp2", "mtp", 2)):
        t, d = timed(drafter, depth)
        res.setdefault(name, []).append((t, d))
for name, v in res.items():
    print(name, "step %.1f ms" % (statistics.median(x[0] for x in v) * 1e3), [round(x[0]*1e3,1) for x in v], "draft %.1f" % (statistics.median(x[1] for x in v) * 1e3))
