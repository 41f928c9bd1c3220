"""Print the calibration cache path `mtplx serve MODEL` (default settings) uses: the engine is
built as the server builds it, its calibration replaced by printing the path."""
import sys

import mtplx  # noqa: F401  (the fast BLAS before MLX)
from mtplx import calibration
from mtplx.engine import DEFAULT_COSTS


def path_only(engine):
    print(calibration._cache_path(engine))
    return DEFAULT_COSTS


calibration.load_or_calibrate = path_only
from server.settings import load_settings  # noqa: E402
from mtplx.commands import engine_factory  # noqa: E402

s = load_settings(None, {"model": sys.argv[1]})
engine_factory(s.model, s.drafter, s.depth, s.draft_layers, s.max_num_seqs,
               s.prefill_chunk_size, s.prefix_cache_bytes, None, s.max_kv_bytes)()
