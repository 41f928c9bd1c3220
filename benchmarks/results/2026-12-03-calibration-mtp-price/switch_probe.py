"""Where a scratch row's depth-1 MTP cycle price departs from a real request's: one MTP row
at a time (the calibration's scratch prompt, or a chat prompt), alternating blocks of BLOCK
steps at depth 0 and depth 1, each depth-1 block paired with the depth-0 block next to it
(so that a slow spell of the shared host weighs on both). Per pair, the ratio of the mean
step (wall, and process CPU) at the positions the calibration times (2 steps after 2
switching steps: positions 2-3) and at steady positions (6 to the end).

    python switch_probe.py ROUNDS BLOCK
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

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
BLOCK = int(sys.argv[2]) if len(sys.argv) > 2 else 16
PAIRS = 3
engine = Engine(load(ensure_default_model()))
engine.warm_up()
CHAT = "Explain why the sky is blue in two sentences."
chat = list(engine.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True))
KINDS = {"scratch": [(7 + i % 8) % engine.vocab_size for i in range(32)], "chat": chat}


def make_row(ids):
    request = GenerationRequest(prompt_ids=ids, sampler=SamplerConfig(temperature=0.0),
                                max_tokens=4000, ignore_eos=True, drafter="mtp", depth=0)
    row = engine.add(request)
    while not row.prefilled:
        engine.step()
    return row


def block(row, depth):
    row.depth = depth
    wall, cpu = [], []
    before = row.num_output_tokens
    for _ in range(BLOCK):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu, row.num_output_tokens - before


def mean(x):
    return sum(x) / len(x)


print("load", os.getloadavg(), flush=True)
res = {k: {"calib": [], "steady": [], "calib_cpu": [], "steady_cpu": [], "d0": [], "d1": [], "tok": []} for k in KINDS}
positions = {k: {0: [[] for _ in range(BLOCK)], 1: [[] for _ in range(BLOCK)]} for k in KINDS}
for r in range(ROUNDS):
    for kind in (list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]):
        row = make_row(KINDS[kind])
        try:
            for _ in range(6):
                engine.step()
            for p in range(PAIRS):
                order = (0, 1) if (r + p) % 2 == 0 else (1, 0)
                got = {}
                for depth in order:
                    got[depth] = block(row, depth)
                    for i, x in enumerate(got[depth][0]):
                        positions[kind][depth][i].append(x)
                w0, c0, _ = got[0]
                w1, c1, t1 = got[1]
                res[kind]["calib"].append(mean(w1[2:4]) / mean(w0[2:4]))
                res[kind]["steady"].append(mean(w1[6:]) / mean(w0[6:]))
                res[kind]["calib_cpu"].append(mean(c1[2:4]) / mean(c0[2:4]))
                res[kind]["steady_cpu"].append(mean(c1[6:]) / mean(c0[6:]))
                res[kind]["d0"].append(mean(w0[6:]))
                res[kind]["d1"].append(mean(w1[6:]))
                res[kind]["tok"].append(t1 / BLOCK)
        finally:
            engine.abort(row)
    print(f"round {r} done, load {os.getloadavg()[0]:.2f}", flush=True)
for kind in KINDS:
    x = res[kind]
    print(f"{kind}: pairs {len(x['calib'])}; depth1/depth0 median of pairs: positions 2-3 wall {statistics.median(x['calib']):.3f} cpu {statistics.median(x['calib_cpu']):.3f}; steady 6+ wall {statistics.median(x['steady']):.3f} cpu {statistics.median(x['steady_cpu']):.3f}; steady d0 {statistics.median(x['d0'])*1e3:.2f} ms d1 {statistics.median(x['d1'])*1e3:.2f} ms; tokens/step at d1 {statistics.median(x['tok']):.2f}")
    for depth in (0, 1):
        print(f"  {kind} d{depth} per position (median ms):", " ".join(f"{statistics.median(p)*1e3:.1f}" for p in positions[kind][depth]))
print("load", os.getloadavg(), flush=True)
