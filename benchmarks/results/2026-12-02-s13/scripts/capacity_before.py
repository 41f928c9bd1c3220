import mtplx, time, statistics
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.batched import batched_target
model = load(ensure_default_model())
bts = {}
for cap in (512, 1024, 2048, 4096):
    bt = batched_target(model.target, 16)
    row = bt.new_row()
    bt._ensure_capacity(cap)
    o = bt.forward([row], [mx.array(list(range(5, 200)), mx.int32)], "last"); mx.eval(o[0].logits)
    bts[cap] = (bt, row)
res = {c: [] for c in bts}
for rep in range(6):
    for cap, (bt, row) in bts.items():
        tok = mx.array([7], mx.int32)
        for i in range(6):
            t0 = time.perf_counter()
            o = bt.forward([row], [tok], "all")
            tok = mx.argmax(o[0].logits[-1:], axis=-1).astype(mx.int32)
            mx.eval(tok)
            if i >= 1: res[cap].append(time.perf_counter() - t0)
        bt.trim(row, 6)
for cap, ts in res.items():
    print(cap, bts[cap][0]._capacity, "median ms %.1f" % (statistics.median(ts) * 1e3))
