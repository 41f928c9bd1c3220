import mtplx  # noqa
import os, statistics
from mtplx import calibration
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
engine = Engine(load(ensure_default_model()))
engine.warm_up()
print("load", os.getloadavg(), "DEPTHS", calibration.DEPTHS)
for _ in range(2):
    print("plain lookup", {k: round(v*1e3, 2) for k, v in calibration.time_steps(engine, 1, (0, *calibration.DEPTHS)).items()})
    print("mtp extra", {k: round(v*1e3, 2) for k, v in calibration.time_drafting(engine, "mtp", calibration.DEPTHS).items()})
