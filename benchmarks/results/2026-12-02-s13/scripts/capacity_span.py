import mtplx, time, statistics, sys
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
import mtplx.models.batched as B
model = load(ensure_default_model())
bts = {}
for step in (64, 256, 100000):
    for cap in (512, 4096):
        B.ATTEND_STEP = step
        bt = B.batched_target(model.target, 16)
        row = bt.new_row()
        bt._ensure_capacity(cap)
        o = bt.forward([row], [mx.array(list(range(5, 200)), mx.int32)], "last"); mx.eval(o[0].logits)
        bts[(step, cap)] = (bt, row)
res = {c: [] for c in bts}
for rep in range(5):
    for key, (bt, row) in bts.items():
        B.ATTEND_STEP = key[0]
        tok = mx.array([7], mx.int32)
        for i in range(6):
            t0 = time.perf_counter()
            o = bt.forward([row], [tok], "all")
            tok = mx.argmax(o[0].logits[-1:], axis=-1).astype(mx.int32)
            mx.eval(tok)
            if i >= 1: res[key].append(time.perf_counter() - t0)
        bt.trim(row, 6)
for key, ts in res.items():
    print(key, "median ms %.1f" % (statistics.median(ts) * 1e3))
# first use of new spans
B.ATTEND_STEP = 64
bt, row = bts[(64, 4096)]
tok = mx.array([7], mx.int32)
for i in range(140):
    t0 = time.perf_counter()
    o = bt.forward([row], [tok], "all")
    tok = mx.argmax(o[0].logits[-1:], axis=-1).astype(mx.int32)
    mx.eval(tok)
    dt = time.perf_counter() - t0
    if dt > 0.06: print("slow step at length", row.length, "%.1f ms" % (dt * 1e3))
