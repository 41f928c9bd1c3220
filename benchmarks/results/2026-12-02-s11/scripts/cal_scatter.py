"""Scatter of repeated calibrations in one process: batch-1 plain, sync, per-token, mtp drafting."""
import sys, time, json
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx import calibration
model = load(ensure_default_model())
engine = Engine(model)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for i in range(n):
    t = time.perf_counter()
    c = calibration.calibrate(engine)
    dt = time.perf_counter() - t
    ms = lambda v: [round(x * 1e3, 1) for x in v]
    be = (c.sync[0] + c.per_token[0] + c.drafting["mtp"][1]) / c.plain[0]
    print(json.dumps({"s": round(dt, 1), "plain": ms(c.plain), "sync": ms(c.sync), "per_token": ms(c.per_token), "mtp": ms(c.drafting["mtp"][:3]), "breakeven1": round(be, 3)}), flush=True)
