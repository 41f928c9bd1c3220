"""Real steady cycle cost in one process: forced depth k (mtp, and scratch-free lookup via ngram is
prompt-dependent so skip) vs plain, alternating, on new chat prompts; compared with the
calibration's model of the same cycles."""
import json, sys, time, statistics
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
from mtplx import calibration
model = load(ensure_default_model())
engine = Engine(model)
costs = calibration.calibrate(engine)
engine.costs = costs; engine.calibrated = True
ms = lambda v: [round(x * 1e3, 1) for x in v]
print("cal plain", ms(costs.plain), "sync", ms(costs.sync), "per_token", ms(costs.per_token), "mtp", ms(costs.drafting["mtp"][:3]), flush=True)
prompts = [json.loads(l)["prompt"] for l in open("benchmarks/prompts-more/chat.jsonl")][: int(sys.argv[1])]
def run(prompt, depth, drafter="mtp"):
    ids = encode_prompt(model.tokenizer, prompt)
    seq = engine.add(GenerationRequest(ids, SamplerConfig(temperature=0), max_tokens=96, drafter=drafter, depth=depth))
    while not seq.prefilled:
        engine.step()
    t = time.perf_counter(); n0 = len(seq.output_ids) if hasattr(seq, "output_ids") else 0
    steps = 0
    while not seq.finished:
        engine.step(); steps += 1
    dt = time.perf_counter() - t
    st = seq.stats
    return dt, steps, st
rows = {0: [], 1: [], 2: []}
for rep in range(2):
    for p in prompts:
        for depth in ((0, 1, 2) if rep % 2 == 0 else (2, 1, 0)):
            dt, steps, st = run(p, depth)
            rows[depth].append((dt, steps, st.accepted_per_position, st.drafted_per_position))
for depth, r in rows.items():
    per_step = statistics.median(dt / s for dt, s, *_ in r)
    tot_t = sum(x[0] for x in r); tot_s = sum(x[1] for x in r)
    acc = [sum(x[2][i] for x in r if len(x[2]) > i) for i in range(depth)]
    dr = [sum(x[3][i] for x in r if len(x[3]) > i) for i in range(depth)]
    print(depth, "median ms/step %.1f, mean %.1f" % (per_step * 1e3, tot_t / tot_s * 1e3), "acc", acc, dr, flush=True)
