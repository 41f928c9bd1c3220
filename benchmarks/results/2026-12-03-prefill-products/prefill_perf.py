"""perf-record 2 TTFTs of 1,500 tokens after a warm-up (perf attached to this process only)."""
import mtplx  # noqa
import os, random, signal, subprocess, sys, time
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig
model = load(ensure_default_model())
engine = Engine(model)
def ttft(seed, n, depth=0):
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    s = engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0), max_tokens=1, ignore_eos=True, depth=depth))
    w, c = time.perf_counter(), time.process_time()
    while not s.finished:
        if any(isinstance(e, TokenEvent) for q, e in engine.step() if q is s): break
    out = (time.perf_counter() - w, time.process_time() - c)
    engine.abort(s)
    return out
ttft(0, 400)
out = sys.argv[1]
p = subprocess.Popen(["perf", "record", "-g", "-F", "499", "-p", str(os.getpid()), "-o", out], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
time.sleep(1.0)
print("load", os.getloadavg())
for i in range(2): print("ttft", ttft(10 + i, 1500), flush=True)
p.send_signal(signal.SIGINT); p.wait()
