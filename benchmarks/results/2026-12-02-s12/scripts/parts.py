"""Per-part compute of a depth-1 MTP cycle (each sub-graph evaluated alone, warm)."""
import time, statistics
import mtplx  # noqa
import mlx.core as mx
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.speculative import Draft, propose, verify, cycle_uniforms
model = load(ensure_default_model())
engine = Engine(model)
bt = engine.batched
prompt = [(7 + i % 50) for i in range(120)]
seq = engine.add(GenerationRequest(prompt, SamplerConfig(temperature=0), max_tokens=4000, drafter="mtp", depth=1))
while not seq.prefilled:
    engine.step()
for _ in range(4): engine.step()
def med(f, n=25):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
row = seq.row
# settle the engine state: no queued/ahead
if seq.queued is not None:
    engine._close_queued(seq, [])
def fwd(n):
    toks = mx.array([11 + j for j in range(n)], mx.int32)
    o = bt.forward([row], [toks], "all"); mx.eval(o[0].logits, o[0].hidden); bt.trim(row, n)
    return o[0]
out2 = fwd(2)
for rnd in range(2):
    print("forward 1 tok %.1f ms, 2 tok %.1f ms" % (med(lambda: fwd(1)), med(lambda: fwd(2))), flush=True)
drafter = seq.drafter
H = model.target.hidden_size
def head_step():
    drafter.commit_lazy(mx.array([5, 6], mx.int32), mx.random.normal((1, 2, H)), mx.array(1, mx.int32))
    d = propose(seq, 1, engine.vocab_size)
    mx.eval(d.tokens, d.qs)
    drafter.settle(1)
    return d
d = head_step()
print("head propose depth 1 (lazy feed of 2 pairs): %.1f ms" % med(head_step), flush=True)
def ver():
    a, t = verify(seq, d, out2); mx.eval(a, t)
print("verify greedy: %.1f ms" % med(ver), flush=True)
seq.request.sampler.__dict__  # noqa
