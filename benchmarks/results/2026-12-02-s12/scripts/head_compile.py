import time, statistics
import mtplx  # noqa
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.lazy_cache import LazyKVCache
model = load(ensure_default_model())
head = model.mtp_heads[0]
H = model.target.hidden_size

class _Fixed:
    """A LazyKVCache view inside a compiled call."""
    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset
    def update_and_fetch(self, k, v):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, k, start, axes=(2,))
        self.values = mx.slice_update(self.values, v, start, axes=(2,))
        return self.keys, self.values

def step(hidden, tokens, keys, values, offset):
    cache = _Fixed(keys, values, offset)
    m = head.module
    emb = m.pre_fc_norm_embedding(head.trunk.embed(tokens))
    x = m.fc(mx.concatenate([emb, m.pre_fc_norm_hidden(hidden)], axis=-1))
    n = tokens.shape[1]; C = keys.shape[2]
    mask = mx.arange(C)[None] <= (offset + mx.arange(n))[:, None]
    x = m.layers[head.index](x, mask, cache)
    out = m.norm(x)
    logits = m.lm_head(out)
    return logits, out, cache.keys, cache.values
cstep = mx.compile(step)

def run(fn, label, n=40):
    cache = head.make_lazy_cache()
    h = mx.random.normal((1, 100, H)); t = mx.array([[5] * 100], mx.int32)
    mx.eval(head(h, t, cache))
    c = cache[0]
    times = []; res = None
    for i in range(n):
        h1 = mx.random.normal((1, 2, H)); t1 = mx.array([[7, 9]], mx.int32); mx.eval(h1)
        s = time.perf_counter()
        if fn is None:
            lg, out = head(h1, t1, cache)
            mx.eval(lg, out)
        else:
            lg, out, k, v = fn(h1, t1, c.keys, c.values, c.offset)
            c.keys, c.values = k, v; c.offset = c.offset + 2; c.bound += 2
            mx.eval(lg, out, k, v)
        times.append(time.perf_counter() - s)
        res = lg
        c.trim_lazily(mx.array(1)); c.settle(1)
    print(label, "%.2f ms" % (statistics.median(times) * 1e3), flush=True)
    return res
for _ in range(2):
    a = run(None, "eager")
    b = run(cstep, "compiled")
print("max diff", mx.abs(a - b).max().item())
