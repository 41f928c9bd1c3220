import json, sys, time
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
model = load(ensure_default_model())
engine = Engine(model)
p = [json.loads(l)["prompt"] for l in open("benchmarks/prompts-more/chat.jsonl")][0]
for rep in range(2):
  for lazy in (False, True):
    engine.batched.trims_lazily = lazy
    ids = encode_prompt(model.tokenizer, p)
    seq = engine.add(GenerationRequest(ids, SamplerConfig(temperature=0.0), max_tokens=64, drafter="mtp", depth=1))
    out = []
    t0 = time.perf_counter()
    while not seq.finished:
        before = seq.num_output_tokens
        t = time.perf_counter()
        engine.step()
        out.append((seq.num_output_tokens - before, (time.perf_counter() - t) * 1e3))
    print(lazy, len(out), "total %.0f ms" % ((time.perf_counter() - t0) * 1e3), "first3", [("%d:%.0f" % o) for o in out[:3]], "last5", [("%d:%.0f" % o) for o in out[-5:]])
