"""Pipelined steps: host build (until the step's async_eval) and the wait in close_queued."""
import json, sys, time, statistics, types
import mtplx  # noqa
import mlx.core as mx
import mtplx.engine as E
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
marks = {}
class MX(types.ModuleType):
    def __getattr__(self, n): return getattr(mx, n)
proxy = MX("mxproxy")
def aev(*a, **k):
    t = time.perf_counter(); marks.setdefault("async_at", t)
    mx.async_eval(*a, **k); marks["async_cost"] = time.perf_counter() - t
proxy.async_eval = aev
E.mx = proxy
orig = E.close_queued
def cq(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); marks["close"] = time.perf_counter() - t; return r
E.close_queued = cq
orig2 = E.close_ahead
def ca(*a, **k):
    t = time.perf_counter(); r = orig2(*a, **k); marks["close"] = time.perf_counter() - t; return r
E.close_ahead = ca
model = load(ensure_default_model())
engine = Engine(model)
prompts = [json.loads(l)["prompt"] for l in open("benchmarks/prompts-more/chat.jsonl")][:3]
for depth in (0, 1, 0, 1, 2):
    build, close, total, acost = [], [], [], []
    for p in prompts:
        ids = encode_prompt(model.tokenizer, p)
        seq = engine.add(GenerationRequest(ids, SamplerConfig(temperature=0), max_tokens=64, drafter="mtp", depth=depth))
        while not seq.prefilled: engine.step()
        while not seq.finished:
            marks.clear(); t = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - t)
            if "async_at" in marks: build.append(marks["async_at"] - t); acost.append(marks["async_cost"])
            if "close" in marks: close.append(marks["close"])
    f = lambda v: "%.1f" % (statistics.median(v) * 1e3) if v else "-"
    print("depth", depth, "step", f(total), "build", f(build), "async_eval", f(acost), "close", f(close), "acc", seq.stats.accepted_per_position, seq.stats.drafted_per_position, flush=True)
