"""Whole greedy requests, as ``benchmarks/cycle_ab.py`` times them (median step of a request,
the first two after the prompt left out), for: the chat prompt with no drafter, with the MTP
drafter at depth 0 and at depth 1; the calibration's scratch prompt with the MTP drafter at
depth 0 and 1. Turn about, the order rotating every round; ratios paired per round.

    python request_kinds.py ROUNDS [TOKENS]
"""
import mtplx  # noqa: F401
import os
import statistics
import sys
import time

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
engine = Engine(load(ensure_default_model()))
CHAT = "Explain why the sky is blue in two sentences."
chat = list(engine.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True))
scratch = [(7 + i % 8) % engine.vocab_size for i in range(32)]
KINDS = {
    "chat none@0": (chat, "none", 0),
    "chat mtp@0": (chat, "mtp", 0),
    "chat mtp@1": (chat, "mtp", 1),
    "scratch mtp@0": (scratch, "mtp", 0),
    "scratch mtp@1": (scratch, "mtp", 1),
}


def run(ids, drafter, depth):
    engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0),
                                 max_tokens=TOKENS, ignore_eos=True, drafter=drafter, depth=depth))
    engine.step()
    wall = []
    while engine.running:
        t = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t)
    return statistics.median(wall[2:])


print("load", os.getloadavg(), flush=True)
names = list(KINDS)
res = {k: [] for k in names}
for r in range(ROUNDS):
    for name in names[r % len(names):] + names[: r % len(names)]:
        res[name].append(run(*KINDS[name]))
for name in names:
    print(f"{name}: median step {statistics.median(res[name])*1e3:.2f} ms")
for a, b in [("chat mtp@1", "chat none@0"), ("chat mtp@1", "chat mtp@0"), ("chat mtp@0", "chat none@0"),
             ("scratch mtp@1", "scratch mtp@0"), ("scratch mtp@0", "chat mtp@0")]:
    pairs = [x / y for x, y in zip(res[a], res[b])]
    print(f"{a} / {b}: median of pairs {statistics.median(pairs):.3f} {[round(p, 3) for p in pairs]}")
print("load", os.getloadavg(), flush=True)
