"""Single-row decode forwards + argmax in a loop (for perf): decode_loop.py FUSED(0|1) COUNT."""
import sys, time
import mtplx  # noqa
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.slot_target import SlotTarget
model = load(ensure_default_model("native"))
target = SlotTarget(model.target, max_rows=4)
target.fuses_layers = sys.argv[1] == "1"
row = target.new_row()
out = target.forward([row], [mx.array(list(range(10, 50)), mx.int32)], "last"); mx.eval(out[0].logits)
tok = mx.array([5], mx.int32)
for i in range(20):
    o = target.forward([row], [tok], "all"); tok = mx.argmax(o[0].logits[-1]).reshape(1).astype(mx.int32); mx.eval(tok)
print("warm", flush=True)
t0 = time.process_time()
for i in range(int(sys.argv[2])):
    o = target.forward([row], [tok], "all"); tok = mx.argmax(o[0].logits[-1]).reshape(1).astype(mx.int32); mx.eval(tok)
    if row.length > 300: target.trim(row, 200)
print("cpu ms/forward", (time.process_time() - t0) * 1e3 / int(sys.argv[2]))
