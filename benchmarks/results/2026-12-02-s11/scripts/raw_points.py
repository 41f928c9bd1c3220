"""Raw per-depth step medians at batch 1 and 4 (what the calibration's line is fitted to)."""
import statistics, json
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx import calibration
engine = Engine(load(ensure_default_model()))
for rep in range(3):
    for b in (1, 4):
        s = calibration.time_steps(engine, b, (0, 1, 2, 3, 4), rounds=3)
        print(b, {k: round(v * 1e3, 1) for k, v in s.items()}, flush=True)
