"""Outputs of the engine of the tree on PYTHONPATH, for the A/B of two trees in two processes:
python gen_outputs.py KIND OUT.json (KIND: a tests/fixtures checkpoint kind, or 'default')."""
import json
import sys
import tempfile
from pathlib import Path

from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent

kind, out = sys.argv[1], sys.argv[2]
if kind == "default":
    from mtplx.models.gguf import ensure_default_model

    model = load(ensure_default_model())
else:
    from tests.fixtures.checkpoints import build_checkpoint

    directory = Path(tempfile.mkdtemp()) / kind
    build_checkpoint(kind, directory)
    model = load(directory)
try:
    draft = make_layer_skip_draft(model, 1)
except Exception:
    draft = None
engine = Engine(model, draft_model=draft)
vocab = model.target.vocab_size
results = {}
import os
wanted = os.environ.get("GEN_DRAFTERS")
for drafter in (wanted.split(",") if wanted else engine.available_drafters):
    for seeded in (False, True):
        for count in (1, 16):
            requests = []
            for index in range(count):
                prompt = [(7 * index + 13 * j * j + 5) % (min(vocab, 250) - 3) + 3 for j in range(5 + 11 * index)]
                sampler = SamplerConfig(temperature=0.8, top_p=0.95, seed=index) if seeded else SamplerConfig(temperature=0.0)
                requests.append(GenerationRequest(prompt_ids=prompt, sampler=sampler, max_tokens=24,
                                                  drafter=drafter, depth=None if drafter == "none" else 3,
                                                  ignore_eos=True))
            rows = {engine.add(r): i for i, r in enumerate(requests)}
            tokens = [[] for _ in requests]
            while engine.running:
                for sequence, event in engine.step():
                    if isinstance(event, BaseException):
                        raise event
                    if isinstance(event, TokenEvent):
                        tokens[rows[sequence]].append(event.token_id)
            results[f"{drafter} {'seeded' if seeded else 'greedy'} x{count}"] = tokens
Path(out).write_text(json.dumps(results))
print(kind, len(results), "runs")
