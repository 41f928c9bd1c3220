import time, statistics
import mtplx  # noqa
import mlx.core as mx
from mlx.utils import tree_flatten
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.lazy_cache import LazyKVCache
model = load(ensure_default_model())
head = model.mtp_heads[0]
print({v.dtype for _, v in tree_flatten(head.module.parameters())})
H = model.target.hidden_size
def bench(cache_factory, label, n=40):
    cache = cache_factory()
    h = mx.random.normal((1, 100, H)); t = mx.array([[5] * 100], mx.int32)
    mx.eval(head(h, t, cache))
    times = []
    for i in range(n):
        h1 = mx.random.normal((1, 2, H)); t1 = mx.array([[7, 9]], mx.int32); mx.eval(h1)
        s = time.perf_counter(); lg, out = head(h1, t1, cache); mx.eval(lg, out); times.append(time.perf_counter() - s)
        if isinstance(cache[0], LazyKVCache): cache[0].trim_lazily(mx.array(1)); cache[0].settle(1)
        else: cache[0].trim(1)
    print(label, "%.2f ms" % (statistics.median(times) * 1e3))
bench(head.make_cache, "KVCache f16")
bench(head.make_lazy_cache, "Lazy f16")
head.module.set_dtype(mx.float32)
bench(head.make_cache, "KVCache f32")
bench(head.make_lazy_cache, "Lazy f32")
# breakdown: head call only vs matmuls only
m = head.module
w = [m.fc.weight, m.layers[0].self_attn.q_proj.weight, m.layers[0].self_attn.k_proj.weight, m.layers[0].self_attn.v_proj.weight, m.layers[0].self_attn.o_proj.weight, m.layers[0].mlp.gate_proj.weight, m.layers[0].mlp.up_proj.weight, m.layers[0].mlp.down_proj.weight, m.lm_head.weight]
def mm():
    x = mx.random.normal((1, 2, 1152)); mx.eval(x)
    s = time.perf_counter()
    outs = [(x[..., : wt.shape[1]] @ wt.T) for wt in w]
    mx.eval(outs); return time.perf_counter() - s
print("matmuls alone %.2f ms" % (statistics.median([mm() for _ in range(40)]) * 1e3))
