"""CPU ms per SlotTarget forward (1 row decoding; 16 rows decoding) on the default model, for
the tree on PYTHONPATH: python forward_cpu.py FORWARDS."""
import sys
import time

import mtplx  # noqa: F401  (first: the fast BLAS)
import mlx.core as mx

from mtplx.models import load
from mtplx.models.batched import SlotTarget
from mtplx.models.gguf import ensure_default_model

count = int(sys.argv[1])
model = load(ensure_default_model())
target = SlotTarget(model.target, max_rows=16)
rows = []
for i in range(16):
    row = target.new_row()
    out = target.forward([row], [mx.array([(13 * j * j + i) % 5000 + 10 for j in range(40)], mx.int32)], "last")
    mx.eval(out[0].logits)
    rows.append(row)
for name, batch in (("1 row", rows[:1]), ("16 rows", rows)):
    tokens = [mx.array([7], mx.int32)] * len(batch)
    for _ in range(5):  # warm
        mx.eval([o.logits for o in target.forward(batch, tokens, "all")])
        for row in batch:
            target.trim(row, 1)
    started = time.process_time()
    for _ in range(count):
        mx.eval([o.logits for o in target.forward(batch, tokens, "all")])
        for row in batch:
            target.trim(row, 1)
    print(f"{name}: {(time.process_time() - started) * 1e3 / count:.2f} ms CPU per forward")
