import json, sys
import mtplx  # noqa
from mtplx import engine as eng_mod
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
import mtplx.planner as planner
model = load(ensure_default_model())
engine = Engine(model)
engine.warm_up()
print("costs", engine.costs if hasattr(engine, "costs") else None)
log = []
orig = eng_mod.plan_cycle
def traced(*a, **k):
    plan = orig(*a, **k); log.append((plan.source, plan.num_draft)); return plan
eng_mod.plan_cycle = traced
prompt = encode_prompt(model.tokenizer, json.loads(open("benchmarks/prompts-more/chat.jsonl").readline())["prompt"])
seq = engine.add(GenerationRequest(prompt, SamplerConfig(temperature=0), max_tokens=96))
while not seq.finished:
    engine.step()
print("".join("." if n == 0 else (("m" if s == "mtp" else "l") + str(n)) + " " for s, n in log))
for name, pol in seq.policies.items() if hasattr(seq, "policies") else []:
    print(name, [round(x,2) for x in pol.tested], [round(x,2) for x in pol.accepted])
print(seq.stats.accepted_per_position, seq.stats.drafted_per_position)
