"""A/B of a single-row forward: compiled pieces vs fused kernels, in one process."""
import os, time, statistics, sys
import mtplx  # noqa
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.slot_target import SlotTarget

model = load(ensure_default_model("native"))
target = SlotTarget(model.target, max_rows=4)
print("fuses_layers", getattr(target, "fuses_layers", None), "attention", target.attention)
row = target.new_row()
prompt = [(7 * j * j + 3) % 5000 + 10 for j in range(40)]
out = target.forward([row], [mx.array(prompt, mx.int32)], "last")
mx.eval(out[0].logits)
tok = mx.argmax(out[0].logits[-1]).reshape(1).astype(mx.int32)

def nodes(arr):
    mx.export_to_dot("/tmp/fuse_graph.dot", arr)
    return sum(1 for line in open("/tmp/fuse_graph.dot") if "shape=rectangle" in line)

def step(fused, tok):
    target.fuses_layers = fused
    t0 = time.thread_time()
    o = target.forward([row], [tok], "all")
    nxt = mx.argmax(o[0].logits[-1]).reshape(1).astype(mx.int32)
    build = time.thread_time() - t0
    return o, nxt, build

layers = len(target.trunk.inner.layers)
for fused in (False, True):
    o, nxt, _ = step(fused, tok)
    n = nodes(nxt)
    mx.eval(nxt)
    target.trunk  # noqa
    print(f"fused={fused}: {n} nodes a forward (+argmax), {n / layers:.1f} a layer")
    tok = nxt

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
res = {False: ([], [], []), True: ([], [], [])}
for i in range(reps):
    for fused in ((False, True) if i % 2 == 0 else (True, False)):
        w0 = time.perf_counter(); p0 = time.process_time()
        o, nxt, build = step(fused, tok)
        mx.eval(nxt)
        p1 = time.process_time(); w1 = time.perf_counter()
        res[fused][0].append(build * 1e3); res[fused][1].append((p1 - p0) * 1e3); res[fused][2].append((w1 - w0) * 1e3)
        tok = nxt
    if row.length > 400:
        target.trim(row, 300)
print("load", os.getloadavg())
for fused in (False, True):
    b, p, w = (statistics.median(v) for v in res[fused])
    print(f"fused={fused}: graph build {b:.2f} ms thread CPU, forward+argmax {p:.2f} ms process CPU (build+eval), {w:.2f} ms wall; eval CPU ~{p - b:.2f}")
