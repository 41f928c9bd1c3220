import cProfile, pstats, time
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
def build(n=50):
    for i in range(n):
        o = bt.forward([row], [mx.array([11, 12], mx.int32)], "all")
        bt.trim(row, 2)
        if i % 10 == 9: mx.eval(o[0].logits)
t = time.perf_counter(); build(); print("per build %.1f ms (incl some evals)" % ((time.perf_counter() - t) / 50 * 1e3))
pr = cProfile.Profile(); pr.enable(); build(); pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(18)
