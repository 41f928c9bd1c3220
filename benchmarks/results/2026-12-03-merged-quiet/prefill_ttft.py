"""A prompt's first token alone, on the default model: prefill_ttft.py COUNT (1,500 random tokens each)."""
import mtplx  # noqa
import random, time, sys
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig
model = load(ensure_default_model())
engine = Engine(model)
def ttft(seed, n):
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    s = engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0), max_tokens=1, ignore_eos=True, depth=0))
    w, c = time.perf_counter(), time.process_time()
    while not s.finished:
        if any(isinstance(e, TokenEvent) for q, e in engine.step() if q is s): break
    print("ttft", time.perf_counter() - w, "cpu", time.process_time() - c, "max_prefill", engine.batched.max_prefill_tokens, flush=True)
    engine.abort(s)
ttft(1, 400)
print("GO", flush=True)
for i in range(int(sys.argv[1])): ttft(10 + i, 1500)
