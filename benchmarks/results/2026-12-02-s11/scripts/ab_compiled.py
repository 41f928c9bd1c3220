"""In one process: plain / mtp@1 / mtp@2 step times with the compiled layers on and off."""
import json, sys, time, statistics
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
model = load(ensure_default_model())
engine = Engine(model)
engine.warm_up()
compiled = engine.batched._compiled
prompts = [json.loads(l)["prompt"] for l in open("benchmarks/prompts-more/chat.jsonl")][: int(sys.argv[1])]
def run(prompt, depth):
    ids = encode_prompt(model.tokenizer, prompt)
    seq = engine.add(GenerationRequest(ids, SamplerConfig(temperature=0), max_tokens=96, drafter="mtp", depth=depth))
    while not seq.prefilled:
        engine.step()
    t = time.perf_counter(); steps = 0
    while not seq.finished:
        engine.step(); steps += 1
    return (time.perf_counter() - t) / steps, seq.stats.accepted_per_position, seq.stats.drafted_per_position, list(seq.output_ids) if hasattr(seq, "output_ids") else None
res = {}
for rep in range(2):
    for p in prompts:
        for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            engine.batched._compiled = compiled if mode == "on" else None
            for depth in (0, 1, 2):
                per_step, acc, dr, out = run(p, depth)
                res.setdefault((mode, depth), []).append(per_step)
for (mode, depth), v in sorted(res.items()):
    print(mode, depth, "median ms/step %.1f mean %.1f" % (statistics.median(v) * 1e3, statistics.mean(v) * 1e3))
