"""CPU ms of one draft depth of 16 rows through a DeepSeek-form MTP head on the test
fixtures: one call per row (``forward_each``) against ``forward_rows`` (packed), turn about:
python deepseek_heads.py KIND STEPS (KIND: deepseek_v3 or deepseek_v4)."""
import sys
import tempfile
import time
from pathlib import Path

import mtplx  # noqa: F401  (first: the fast BLAS)
import mlx.core as mx

from mtplx.models import load
from mtplx.models.base import forward_each
from tests.fixtures.checkpoints import build_checkpoint

kind, steps = sys.argv[1], int(sys.argv[2])
directory = Path(tempfile.mkdtemp()) / kind
build_checkpoint(kind, directory)
model = load(directory)
head = model.mtp_heads[0]
size = model.target.hidden_size
best = {"each": float("inf"), "packed": float("inf")}
for round_ in range(4):
    for way in ("each", "packed") if round_ % 2 == 0 else ("packed", "each"):
        caches = [head.make_cache() for _ in range(16)]
        prompt = [mx.random.normal((1, 12, size), key=mx.random.key(r)) for r in range(16)]
        tokens = [mx.array([[(5 * r + i) % 50 + 3 for i in range(12)]]) for r in range(16)]
        mx.eval(forward_each(head, prompt, tokens, caches))
        hidden = [h[:, -1:] for h in prompt]
        started = time.process_time()
        for step in range(steps):
            step_tokens = [mx.array([[(step + r) % 50 + 3]]) for r in range(16)]
            if way == "each":
                outputs = forward_each(head, hidden, step_tokens, caches)
            else:
                outputs = head.forward_rows(hidden, step_tokens, caches)
            mx.eval(outputs)
            hidden = [out for _, out in outputs]
        best[way] = min(best[way], (time.process_time() - started) * 1e3 / steps)
print(f"{kind}: 16 rows a depth, one call per row {best['each']:.2f} ms CPU, "
      f"packed {best['packed']:.2f} ms CPU ({best['each'] / best['packed']:.2f}x)")
