"""Depth-1 MTP cycle priced by repeated calibrations: cost(1) / cost(0) at batch 1."""
import mtplx  # noqa
import os, sys
from mtplx import calibration
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
engine = Engine(load(ensure_default_model()))
engine.warm_up()
import functools
if len(sys.argv) > 2:
    calibration._timed_steps = functools.partial(calibration._timed_steps, steps=int(sys.argv[2]))
print("load", os.getloadavg())
for i in range(int(sys.argv[1])):
    costs = engine.priced(calibration.calibrate(engine))
    row = costs.row_costs("mtp", 1, 2)
    print("plain %.2f ms  mtp@1 %.2f ms  ratio %.3f  drafting %s" % (row[0]*1e3, row[1]*1e3, row[1]/row[0], [round(x*1e3, 2) for x in costs.drafting["mtp"][:3]]), flush=True)
print("load", os.getloadavg())
