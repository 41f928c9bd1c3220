"""A forward's matmuls alone (30 layers of SmolLM2-135M shapes + lm_head), M = 1, 2, 3, 5 rows."""
import statistics, time, sys
import mtplx  # noqa
import mlx.core as mx
from mtplx.blas import blas_info
print(blas_info())
H, I, V, KV = 576, 1536, 49152, 192
layers = [dict(qkv=mx.random.normal((H + 2 * KV, H)) * 0.02, o=mx.random.normal((H, H)) * 0.02,
               gu=mx.random.normal((2 * I, H)) * 0.02, d=mx.random.normal((H, I)) * 0.02) for _ in range(30)]
head = mx.random.normal((V, H)) * 0.02
mx.eval(layers, head)
def fwd(x):
    for L in layers:
        q = x @ L["qkv"].T
        x = x + (q[:, :H]) @ L["o"].T
        g = x @ L["gu"].T
        x = x + (g[:, :I] * mx.sigmoid(g[:, I:])) @ L["d"].T
    return x @ head.T
def timed(M, reps=15):
    ts = []
    for i in range(reps):
        x = mx.random.normal((M, H)); mx.eval(x)
        t = time.perf_counter(); mx.eval(fwd(x)); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
for rnd in range(3):
    print(" ".join(f"M={M} {timed(M):.1f}" for M in (1, 2, 3, 5, 8)), flush=True)
