"""A 1,500-token prompt's first token alone, the trunk's layers one node or five, turn about."""
import mtplx  # noqa
import os, random, statistics, time
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig
model = load(ensure_default_model())
engine = Engine(model)
target = engine.batched
def ttft(seed, n):
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    s = engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0), max_tokens=1, ignore_eos=True, depth=0))
    w, c = time.perf_counter(), time.process_time()
    while not s.finished:
        if any(isinstance(e, TokenEvent) for q, e in engine.step() if q is s): break
    out = (time.perf_counter() - w, time.process_time() - c)
    engine.abort(s)
    return out
ttft(0, 400)
print("load before", os.getloadavg())
res = {True: [], False: []}
for r in range(6):
    for setting in ((True, False) if r % 2 == 0 else (False, True)):
        target.layer_node = setting
        res[setting].append(ttft(100 + r, 1500))
print("load after", os.getloadavg())
for s in (True, False):
    print("one node" if s else "five nodes", "wall median %.3f s, cpu median %.3f s" % (statistics.median(x[0] for x in res[s]), statistics.median(x[1] for x in res[s])), [round(x[0], 2) for x in res[s]])
print("paired wall ratios one/five", [round(a[0] / b[0], 3) for a, b in zip(res[True], res[False])])
