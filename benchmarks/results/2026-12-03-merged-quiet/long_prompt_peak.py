"""Peak RSS of one long prompt through the engine: long_prompt_peak.py DRAFTER TOKENS."""
import mtplx, sys, threading, time, random
import mlx.core as mx
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
def rss(): return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])//1024
peak = [0]; stop = False
def watch():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.05)
m = load(ensure_default_model())
e = Engine(m, default_drafter=sys.argv[1])
threading.Thread(target=watch, daemon=True).start()
rng = random.Random(1); ids = [rng.randrange(1000, 40000) for _ in range(int(sys.argv[2]))]
print("before", rss(), flush=True)
s = e.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0), max_tokens=8))
while not s.finished:
    e.step()
print(sys.argv[1], "peak rss", peak[0], "after", rss(), "mlx peak", mx.get_peak_memory()>>20, "active", mx.get_active_memory()>>20, "cache", mx.get_cache_memory()>>20, "kv", e.batched.kv_nbytes>>20, flush=True)
