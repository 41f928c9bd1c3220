"""Cache the quiet pass's served calibration (``../2026-12-03-bars-quiet-4/
calibration-served.json``) under this process's MTPLX_HOME with this machine's key, so that
every server and engine of this pass prices depths the same quiet way (on this loaded host
a start-up calibration is not cached and differs from start to start)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import mtplx  # noqa: E402,F401
from mtplx.calibration import _cache_path, _write_cache, cache_document  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.planner import StepCosts  # noqa: E402

quiet = json.loads((ROOT / "benchmarks/results/2026-12-03-bars-quiet-4/calibration-served.json").read_text())
engine = Engine(load(ensure_default_model("native")))
costs = StepCosts(**quiet["costs"])
path = _cache_path(engine)
path.parent.mkdir(parents=True, exist_ok=True)
_write_cache(path, cache_document(engine, costs))
print("wrote", path)
