"""mtp@1 steps with drafts evaluated on their own (sync, the old path) vs computed under the
forward's graph building (async), alternating in one process; plus plain steps."""
import statistics, time
import mtplx  # noqa
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.train.compare import prompt_messages
from mtplx.train.data import chat_prompt_ids

model = load(ensure_default_model())
engine = Engine(model)
prompts = [chat_prompt_ids(model.tokenizer, t, h) for t, h in prompt_messages("broad", 3)]
res = {}
for rnd in range(3):
    for mode in ("plain", "sync", "async"):
        engine.time_drafts = mode == "sync"
        steps, toks = [], 0
        for p in prompts:
            seq = engine.add(GenerationRequest(p, SamplerConfig(temperature=0), max_tokens=48, drafter="mtp", depth=0 if mode == "plain" else 1))
            while not seq.prefilled or seq.pending is not None:
                engine.step()
            while not seq.finished:
                t = time.perf_counter(); ev = engine.step(); steps.append(time.perf_counter() - t)
                toks += sum(1 for _, e in ev if hasattr(e, "token_id"))
            engine.abort(seq)
        res.setdefault(mode, []).append((statistics.median(steps) * 1e3, sum(steps) / toks * 1e3))
        print(rnd, mode, f"median step {res[mode][-1][0]:.1f} ms, {res[mode][-1][1]:.1f} ms/token", flush=True)
for mode, v in res.items():
    print(mode, "median of medians", round(statistics.median(x[0] for x in v), 1), "ms/token", round(statistics.median(x[1] for x in v), 1))
