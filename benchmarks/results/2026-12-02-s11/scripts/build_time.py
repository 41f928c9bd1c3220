"""Graph building vs evaluation of one slot-row forward (1 and 2 tokens)."""
import time, statistics
import mtplx  # noqa
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.batched import batched_target
model = load(ensure_default_model())
bt = batched_target(model.target, 16)
row = bt.new_row()
prompt = mx.array([(7 + i % 50) for i in range(100)], mx.int32)
out = bt.forward([row], [prompt], "last"); mx.eval(out[0].logits)
for rnd in range(3):
    for n in (1, 2):
        b, e = [], []
        for i in range(20):
            toks = mx.array([11 + (i + j) % 40 for j in range(n)], mx.int32)
            t0 = time.perf_counter()
            o = bt.forward([row], [toks], "all")
            t1 = time.perf_counter()
            mx.eval(o[0].logits)
            t2 = time.perf_counter()
            b.append(t1 - t0); e.append(t2 - t1)
            bt.trim(row, n)
        print(n, "build %.1f ms eval %.1f ms total %.1f" % (statistics.median(b) * 1e3, statistics.median(e) * 1e3, statistics.median([x + y for x, y in zip(b, e)]) * 1e3), flush=True)
