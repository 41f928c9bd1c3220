"""Per-cycle cost of plain vs mtp@1 steps, single stream, T=0, in process; phases of _run."""
import json, statistics, sys, time
import mtplx  # noqa
import mlx.core as mx
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.train.compare import prompt_messages
from mtplx.train.data import chat_prompt_ids
from mtplx.train.multi_draft import verify_costs

model = load(ensure_default_model())
engine = Engine(model)
prompts = [chat_prompt_ids(model.tokenizer, t, h) for t, h in prompt_messages("broad", 4)]
orig_eval = mx.eval
phase = {"eval_s": 0.0, "evals": 0}
def timed_eval(*a, **k):
    t = time.perf_counter(); r = orig_eval(*a, **k); phase["eval_s"] += time.perf_counter() - t; phase["evals"] += 1; return r
import mtplx.engine as eng_mod
eng_mod.mx.eval = timed_eval
out = {}
for rnd in range(2):
  for depth in (0, 1):
    steps, n_tok = [], 0
    phase["eval_s"], phase["evals"] = 0.0, 0
    for p in prompts:
        req = GenerationRequest(p, SamplerConfig(temperature=0), max_tokens=64, drafter="mtp", depth=depth)
        seq = engine.add(req)
        while not seq.prefilled or seq.pending is not None:
            engine.step()
        while not seq.finished:
            t = time.perf_counter(); ev = engine.step(); dt = time.perf_counter() - t
            steps.append(dt); n_tok += sum(1 for _, e in ev if hasattr(e, "token_id"))
        engine.abort(seq)
    key = f"depth{depth}"
    out.setdefault(key, []).append({"steps": len(steps), "tokens": n_tok, "median_step_ms": statistics.median(steps)*1e3,
        "mean_step_ms": statistics.mean(steps)*1e3, "ms_per_token": sum(steps)/n_tok*1e3, "eval_ms_per_step": phase["eval_s"]/len(steps)*1e3, "evals_per_step": phase["evals"]/len(steps)})
    print(key, out[key][-1], flush=True)
costs = verify_costs(model, 3)
print("costs_ms", {k: round(v*1e3, 2) for k, v in costs.items()})
