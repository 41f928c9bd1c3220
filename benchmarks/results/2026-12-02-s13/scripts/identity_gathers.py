import mtplx, time, statistics, sys
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
import mtplx.models.batched as B
model = load(ensure_default_model())
orig_padded = B._padded
def fast_padded(projected, group, num_heads):
    if group.num_slots == 1 and group.start == 0 and group.end == group.max_tokens:
        return projected[: group.end].reshape(1, group.max_tokens, num_heads, -1).transpose(0, 2, 1, 3)
    return orig_padded(projected, group, num_heads)
orig_compiled = B.SlotTarget._compiled_layers
bts = {}
for mode in ("gather", "identity"):
    bt = B.batched_target(model.target, 16)
    row = bt.new_row()
    o = bt.forward([row], [mx.array(list(range(5, 100)), mx.int32)], "last"); mx.eval(o[0].logits)
    bts[mode] = (bt, row)
res = {m: [] for m in bts}
outs = {m: [] for m in bts}
for rep in range(6):
    for mode, (bt, row) in bts.items():
        B._padded = fast_padded if mode == "identity" else orig_padded
        tok = mx.array([7], mx.int32)
        for i in range(8):
            t0 = time.perf_counter()
            o = bt.forward([row], [tok], "all")
            tok = mx.argmax(o[0].logits[-1:], axis=-1).astype(mx.int32)
            mx.eval(tok)
            if i >= 1: res[mode].append(time.perf_counter() - t0)
            if rep == 0: outs[mode].append(o[0].logits)
        bt.trim(row, 8)
for m, ts in res.items():
    print(m, "median ms %.2f" % (statistics.median(ts) * 1e3))
print("same bits", all(mx.array_equal(a, b).item() for a, b in zip(outs["gather"], outs["identity"])))
