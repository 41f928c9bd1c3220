import mtplx, resource
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.batched import batched_target
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) // 1024
model = load(ensure_default_model())
bt = batched_target(model.target, 16, keep_hidden=True)
print("start", rss(), mx.get_active_memory() >> 20, mx.get_cache_memory() >> 20)
row = bt.new_row()
for s in range(0, 2000, 32):
    o = bt.forward([row], [mx.array(list(range(5, 37)), mx.int32)], "none"); mx.eval(o[0].hidden, *bt.unevaluated())
print("grown", bt._capacity, rss(), mx.get_active_memory() >> 20, mx.get_cache_memory() >> 20, "peak", mx.get_peak_memory() >> 20)
bt.release(row)
print("released", bt._capacity, rss(), mx.get_active_memory() >> 20, mx.get_cache_memory() >> 20)
