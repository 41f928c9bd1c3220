"""A 1,500-token prompt's first token alone, int8 products of many rows in their own tiles
(6 x 2) or in the few-row tiles (6 x 3), turn about in one process (the same bits)."""
import mtplx  # noqa
import os, random, statistics, sys, time
import mlx.core as mx
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.quant import load_extension
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig
model = load(ensure_default_model())
engine = Engine(model)
ext = load_extension()
def ttft(seed, n):
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    s = engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0), max_tokens=1, ignore_eos=True, depth=0))
    w, c = time.perf_counter(), time.process_time()
    token = None
    while not s.finished:
        hit = [e for q, e in engine.step() if q is s and isinstance(e, TokenEvent)]
        if hit:
            token = hit[0]
            break
    out = (time.perf_counter() - w, time.process_time() - c)
    engine.abort(s)
    return out, token
ttft(0, 400)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
print("load before", os.getloadavg(), flush=True)
res = {True: [], False: []}
tokens = {True: [], False: []}
for r in range(rounds):
    for setting in ((True, False) if r % 2 == 0 else (False, True)):
        ext.set_many_rows_tiles(setting)
        (t, tok) = ttft(100 + r, 1500)
        res[setting].append(t)
        tokens[setting].append(getattr(tok, "token", tok))
        print("round", r, "6x2" if setting else "6x3", "wall %.3f cpu %.3f" % t, "load %.2f" % os.getloadavg()[0], flush=True)
print("load after", os.getloadavg())
for s in (True, False):
    print("6x2 tiles" if s else "6x3 tiles", "wall median %.3f s, cpu median %.3f s" % (statistics.median(x[0] for x in res[s]), statistics.median(x[1] for x in res[s])), [round(x[0], 2) for x in res[s]])
print("paired cpu ratios 6x2/6x3", [round(a[1] / b[1], 3) for a, b in zip(res[True], res[False])])
print("paired wall ratios 6x2/6x3", [round(a[0] / b[0], 3) for a, b in zip(res[True], res[False])])
print("same first tokens:", tokens[True] == tokens[False])
