"""Per-step wall times of one MTP row at depth 0 and depth 1, in alternating blocks, for
several kinds of row (the calibration's scratch row, real chat text): where the scratch
timing of a depth-1 cycle departs from a real request's.

    python step_probe.py ROUNDS BLOCK
"""
import mtplx  # noqa: F401
import os
import statistics
import sys
import time

from mtplx import calibration
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
BLOCK = int(sys.argv[2]) if len(sys.argv) > 2 else 30
engine = Engine(load(ensure_default_model()))
engine.warm_up()
CHAT = "Explain why the sky is blue in two sentences."


def chat_ids(text):
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def scratch_ids():
    return [(7 + i % 8) % engine.vocab_size for i in range(32)]


KINDS = {
    "scratch": scratch_ids,
    "chat": lambda: chat_ids(CHAT),
}


def make_row(ids):
    request = GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0),
                                max_tokens=4000, ignore_eos=True, drafter="mtp", depth=0)
    row = engine.add(request)
    while not row.prefilled:
        engine.step()
    return row


def block(row, depth, n):
    row.depth = depth
    times, committed = [], []
    for _ in range(n):
        before = row.num_output_tokens
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        cpu[-1].append(time.process_time() - c)
        committed.append(row.num_output_tokens - before)
    return times, committed


print("load", os.getloadavg(), flush=True)
per = {k: {0: [], 1: []} for k in KINDS}  # per-position lists
tok = {k: {0: 0, 1: 0} for k in KINDS}
ratios = {k: [] for k in KINDS}
cratios = {k: [] for k in KINDS}
walls = {k: [] for k in KINDS}
cpus = {k: [] for k in KINDS}
cpu = [[]]
for r in range(ROUNDS):
    order = list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]
    for kind in order:
        row = make_row(KINDS[kind]())
        try:
            block(row, 0, 6)
            meds, cmeds = {}, {}
            for depth in ((0, 1) if r % 2 == 0 else (1, 0)):
                cpu.append([])
                times, committed = block(row, depth, BLOCK)
                cmeds[depth] = statistics.median(cpu[-1][4:])
                per[kind][depth].append(times)
                tok[kind][depth] += sum(committed[4:])
                meds[depth] = statistics.median(times[4:])
            ratios[kind].append(meds[1] / meds[0])
            cratios[kind].append(cmeds[1] / cmeds[0])
            walls[kind].append(meds)
            cpus[kind].append(cmeds)
            print(f"round {r} {kind}: d0 {meds[0]*1e3:.2f} d1 {meds[1]*1e3:.2f} ratio {meds[1]/meds[0]:.3f} cpu d0 {cmeds[0]*1e3:.2f} d1 {cmeds[1]*1e3:.2f} ratio {cmeds[1]/cmeds[0]:.3f} ctx {len(row.tokens)}", flush=True)
        finally:
            engine.abort(row)
for kind in KINDS:
    for depth in (0, 1):
        runs = per[kind][depth]
        pos = [statistics.median(run[i] for run in runs) * 1e3 for i in range(BLOCK)]
        print(f"{kind} depth {depth} per position after switch (ms):", " ".join(f"{x:.1f}" for x in pos))
        steps = len(runs) * (BLOCK - 4)
        print(f"  tokens/step (steady) {tok[kind][depth]/steps:.3f}")
    for depth in (0, 1):
        print(f"{kind} depth {depth}: median wall {statistics.median(m[depth] for m in walls[kind])*1e3:.2f} cpu {statistics.median(m[depth] for m in cpus[kind])*1e3:.2f} ms")
    print(f"{kind} cpu ratio d1/d0 per round: {[round(x, 3) for x in cratios[kind]]} median {statistics.median(cratios[kind]):.3f}")
    print(f"{kind} ratio d1/d0 per round: {[round(x, 3) for x in ratios[kind]]} median {statistics.median(ratios[kind]):.3f}")
print("load", os.getloadavg(), flush=True)
