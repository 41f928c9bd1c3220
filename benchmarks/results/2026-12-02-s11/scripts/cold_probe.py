import time, sys
sys.argv = ["x"]
exec(open("benchmarks/results/2026-12-02-s11/scripts/compiled_proto.py").read().split("model = load")[0])
import mlx.core as mx
model = load(ensure_default_model())
new = Compiled(model.target, 16)
rows = [new.new_row() for _ in range(4)]
t = time.perf_counter()
o = new.forward([rows[0]], [mx.arange(5, 37).astype(mx.int32)], "last"); mx.eval(o[0].logits)
print("first 32-token %.0f ms" % ((time.perf_counter() - t) * 1e3), flush=True)
for shape in ([1], [2], [1, 1], [3, 1], [1, 1, 1, 1], [5, 2, 1]):
    t = time.perf_counter()
    o = new.forward(rows[: len(shape)], [mx.arange(n).astype(mx.int32) + 9 for n in shape], "all"); mx.eval([x.logits for x in o])
    print(shape, "%.0f ms" % ((time.perf_counter() - t) * 1e3), flush=True)
