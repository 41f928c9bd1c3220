"""Whole greedy chat requests, plain (no drafter) and mtp@1, turn about: per pair the ratio
of the MEDIAN step (``benchmarks/cycle_ab.py``'s measure, and the calibration's), of the MEAN
step (what throughput pays), and the decode speed-up (tokens / seconds, mtp@1 over plain),
with the tokens a step commits. Also the same for the MTP row of the calibration's blocks
(depth 0 / depth 1 on one row, blocks of STEPS steps): median and mean.

    python mean_vs_median.py PAIRS [TOKENS]
"""
import mtplx  # noqa: F401
import json
import os
import statistics
import sys
import time
from pathlib import Path

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig

PAIRS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 96
ROOT = Path(__file__).resolve().parents[3]
engine = Engine(load(ensure_default_model()))
prompts = [json.loads(line) for line in open(ROOT / "benchmarks/prompts-more/chat.jsonl")]


def ids_of(prompt):
    messages = prompt.get("messages") or [{"role": "user", "content": prompt.get("prompt") or prompt.get("content")}]
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run(ids, drafter, depth):
    seq = engine.add(GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0),
                                       max_tokens=TOKENS, ignore_eos=True, drafter=drafter, depth=depth))
    engine.step()
    start_tokens = seq.num_output_tokens
    wall = []
    while engine.running:
        t = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t)
    steps = wall[2:]
    return statistics.median(steps), statistics.mean(steps), (seq.num_output_tokens - start_tokens) / sum(wall)


print("load", os.getloadavg(), flush=True)
med, mean, speed = [], [], []
for p in range(PAIRS):
    ids = ids_of(prompts[p % len(prompts)])
    got = {}
    for kind in (("none", 0), ("mtp", 1)) if p % 2 == 0 else (("mtp", 1), ("none", 0)):
        got[kind[0]] = run(ids, *kind)
    med.append(got["mtp"][0] / got["none"][0])
    mean.append(got["mtp"][1] / got["none"][1])
    speed.append(got["mtp"][2] / got["none"][2])
    print(f"pair {p}: median-step ratio {med[-1]:.3f} mean-step ratio {mean[-1]:.3f} speed-up {speed[-1]:.3f} "
          f"(plain median {got['none'][0]*1e3:.2f} mean {got['none'][1]*1e3:.2f} ms) load {os.getloadavg()[0]:.2f}", flush=True)
print(f"median over pairs: median-step ratio {statistics.median(med):.3f}, mean-step ratio {statistics.median(mean):.3f}, speed-up {statistics.median(speed):.3f}")
print("load", os.getloadavg(), flush=True)
