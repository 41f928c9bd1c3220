"""Graph-building time of the MLP half of 30 layers, plain ops vs mx.compile (keyed by shape)."""
import time, statistics
import mtplx  # noqa
import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.batched import batched_target
model = load(ensure_default_model())
bt = batched_target(model.target, 16)
layers = bt.trunk.inner.layers
fused = bt._fused
def mlp_half(x, attn_out, norm_w, gate_up, down, eps):
    x = x + attn_out
    h = mx.fast.rms_norm(x, norm_w, eps)
    gu = h @ gate_up.T
    size = gate_up.shape[0] // 2
    return x + swiglu(gu[..., :size], gu[..., size:]) @ down.T
compiled = mx.compile(mlp_half)
def build(fn, x):
    for layer, f in zip(layers, fused):
        ln = layer.post_attention_layernorm
        x = fn(x, x, ln.weight, f.gate_up, layer.mlp.down_proj.weight, ln.eps)
    return x
x = mx.random.normal((1, 2, 576)); mx.eval(x)
for fn, name in ((mlp_half, "ops"), (compiled, "compiled")):
    mx.eval(build(fn, x))  # trace
    bs, es, outs = [], [], None
    for _ in range(20):
        t0 = time.perf_counter(); y = build(fn, x); t1 = time.perf_counter(); mx.eval(y); t2 = time.perf_counter()
        bs.append(t1 - t0); es.append(t2 - t1); outs = y
    print(name, "build %.2f ms eval %.2f ms" % (statistics.median(bs) * 1e3, statistics.median(es) * 1e3))
    if name == "ops": ref = outs
print("max abs diff", mx.max(mx.abs(ref - outs)).item(), "bitwise equal", bool(mx.array_equal(ref, outs).item()))
