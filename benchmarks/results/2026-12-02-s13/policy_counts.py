"""The adaptive policy's schedule with and without optimism, in one process, greedy (the same
text either way): every cycle's source and depth, priced with the engine's calibrated costs
(modelled time, free of this machine's timing noise), and the wall time.
Usage: python policy_counts.py [optimism ...]"""
import json, sys, time
import mtplx  # noqa: F401  (before mlx: the BLAS shim)
import mtplx.depth_policy as policy_module
import mtplx.engine as engine_module
from mtplx.bench.prompts import encode_prompt, load_prompts
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from pathlib import Path

model = load(ensure_default_model())
engine = Engine(model)
engine.warm_up()
costs = engine.costs
prompts = [p.text for p in load_prompts(Path("benchmarks/prompts-more"), ["chat"])]
prompts += [p.text for p in load_prompts(Path("benchmarks/prompts"), ["chat", "code", "summarize"])]
plans = []
original = engine_module.plan_cycle
engine_module.plan_cycle = lambda *a, **k: plans.append(original(*a, **k)) or plans[-1]
defaults = list(policy_module.AdaptiveDepth.__init__.__defaults__)
results = {}
for optimism in [float(z) for z in sys.argv[1:]] or [0.0, 1.0]:
    defaults[-1] = optimism
    policy_module.AdaptiveDepth.__init__.__defaults__ = tuple(defaults)
    tokens = modelled = wall = drafted = cycles = 0
    texts = []
    for text in prompts:
        plans.clear()
        seq = engine.add(GenerationRequest(encode_prompt(model.tokenizer, text), SamplerConfig(temperature=0.0), max_tokens=96))
        while not seq.prefilled:
            engine.step()
        started = time.perf_counter()
        while not seq.finished:
            engine.step()
        wall += time.perf_counter() - started
        tokens += seq.num_output_tokens - 1
        for plan in plans:
            row = costs.row_costs(plan.source or "mtp", 1, max(plan.num_draft, 1))
            modelled += row[plan.num_draft]
            drafted += plan.num_draft > 0
            cycles += 1
        texts.append(seq.text if hasattr(seq, "text") else seq.tokens[-(seq.num_output_tokens):])
    plain_time = tokens * costs.row_costs("mtp", 1, 1)[0]
    results[optimism] = texts
    print(f"optimism {optimism}: {len(prompts)} prompts, {tokens} tokens, {cycles} cycles "
          f"({drafted} drafting); modelled speed-up {plain_time / modelled:.3f}x; "
          f"wall {tokens / wall:.2f} tok/s", flush=True)
keys = list(results)
print("same outputs:", all(results[keys[0]][i] == results[k][i] for k in keys for i in range(len(prompts))))
