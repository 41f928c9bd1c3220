"""A/B in one process: 16 rows decoding together, and a 128-token prefill chunk."""
import os, time, statistics
import mtplx  # noqa
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.slot_target import SlotTarget

model = load(ensure_default_model("native"))
target = SlotTarget(model.target, max_rows=17)
rows = [target.new_row() for _ in range(16)]
for i, row in enumerate(rows):
    out = target.forward([row], [mx.array([(13 * j * j + i) % 5000 + 10 for j in range(30)], mx.int32)], "last")
    mx.eval(out[0].logits)
chunk_row = target.new_row()
res = {(k, f): [] for k in ("16 rows", "prefill 128") for f in (False, True)}
for i in range(12):
    for fused in ((False, True) if i % 2 == 0 else (True, False)):
        target.fuses_layers = fused
        p0 = time.process_time()
        o = target.forward(rows, [mx.array([7 + i], mx.int32)] * 16, "all")
        mx.eval([x.logits for x in o])
        res[("16 rows", fused)].append((time.process_time() - p0) * 1e3)
        for row in rows:
            target.trim(row, 1)
        p0 = time.process_time()
        o = target.forward([chunk_row], [mx.array([(5 * j + i) % 5000 + 10 for j in range(128)], mx.int32)], "last")
        mx.eval(o[0].logits)
        res[("prefill 128", fused)].append((time.process_time() - p0) * 1e3)
        target.trim(chunk_row, 128)
print("load", os.getloadavg())
for (kind, fused), v in res.items():
    print(f"{kind} fused={fused}: {statistics.median(v):.2f} ms process CPU per forward (median of {len(v)})")
