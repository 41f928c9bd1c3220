"""A/B in one process: pipelined MTP cycles on/off (batched.trims_lazily), plain as reference."""
import json, sys, time, statistics
import mtplx  # noqa
import mlx.core as mx
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
model = load(ensure_default_model())
engine = Engine(model)
prompts = [json.loads(l)["prompt"] for l in open("benchmarks/prompts-more/chat.jsonl")][: int(sys.argv[1])]
T = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
def run(p, depth, lazy):
    engine.batched.trims_lazily = lazy
    ids = encode_prompt(model.tokenizer, p)
    seq = engine.add(GenerationRequest(ids, SamplerConfig(temperature=T, seed=7), max_tokens=64, drafter="mtp", depth=depth))
    while not seq.prefilled: engine.step()
    t = time.perf_counter(); steps = 0
    while not seq.finished: engine.step(); steps += 1
    dt = time.perf_counter() - t
    return dt, steps, seq.stats.completion_tokens - 1, seq.stats
res = {}
for rep in range(2):
    for p in prompts:
        for key in ([(0, True), (1, False), (1, True)] if rep % 2 == 0 else [(1, True), (1, False), (0, True)]):
            res.setdefault(key, []).append(run(p, *key))
for key, r in res.items():
    ms_step = statistics.median(dt / s for dt, s, *_ in r) * 1e3
    tps = sum(n for _, _, n, _ in r) / sum(dt for dt, *_ in r)
    acc = sum(st.accepted_per_position[0] for *_, st in r if st.accepted_per_position)
    dr = sum(st.drafted_per_position[0] for *_, st in r if st.drafted_per_position)
    mean = sum(dt for dt, *_ in r) / sum(s for _, s, *_ in r) * 1e3
    print(key, "ms/step median %.1f mean %.1f steps %d tok/s %.2f acc %d/%d" % (ms_step, mean, sum(s for _, s, *_ in r), tps, acc, dr), flush=True)
