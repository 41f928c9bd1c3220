"""Paired, in-process A/B of the MTP head's step alone on the default model: the fused head
against mlx-lm's layer (``NextNHead.fuses_layer``), turn about.

Each step is what a depth-1 cycle asks of the head: feed 2 committed pairs over a cache of
~60 positions and draw 1 greedy draft token. Per step: the engine thread's CPU milliseconds
to build the graph, and the wall and process-CPU milliseconds to evaluate it (median and
minimum over all steps).

    python benchmarks/results/2026-12-03-mtp-head-fused/head_ab.py [--steps 40] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from mtplx.drafters.base import DraftSampler  # noqa: E402
from mtplx.drafters.mtp import MTPDrafter  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

GREEDY = SamplerConfig(temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model = load(ensure_default_model("native"))
    head = model.mtp_heads[0]
    vocab = model.target.vocab_size
    prompt = list(range(100, 160))
    hidden = mx.random.normal((1, len(prompt), model.target.trunk.hidden_size))
    mx.eval(hidden)
    drafters = {}
    for fused in (False, True):
        head.fuses_layer = fused
        drafter = MTPDrafter(model)
        drafter.reset(prompt)
        drafter.commit(prompt, hidden)
        sampler = DraftSampler(GREEDY, vocab, mx.zeros((1,)), None, drafter.draft_vocab)
        mx.eval(drafter.propose(prompt, 1, sampler)[0])
        drafters[fused] = drafter
    times: dict[bool, tuple[list[float], list[float], list[float]]] = {
        f: ([], [], []) for f in drafters
    }
    print(f"load before: {os.getloadavg()}")
    for _ in range(args.rounds):
        for fused, drafter in drafters.items():
            head.fuses_layer = fused
            build, wall, cpu = times[fused]
            for _ in range(args.steps):
                drafter.commit([7, 9], hidden[:, :2])
                sampler = DraftSampler(GREEDY, vocab, mx.zeros((1,)), None, drafter.draft_vocab)
                start = time.thread_time()
                tokens, _ = drafter.propose(prompt, 1, sampler)
                build.append(time.thread_time() - start)
                start, cpu_start = time.perf_counter(), time.process_time()
                mx.eval(tokens)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
    head.fuses_layer = True
    print(f"load after: {os.getloadavg()}")
    print("| head step, ms | build (thread CPU) | eval wall | eval process CPU |")
    print("|---|---|---|---|")
    for fused, series in times.items():
        cells = " | ".join(
            f"{1e3 * statistics.median(s):.2f} (min {1e3 * min(s):.2f})" for s in series
        )
        print(f"| {'fused' if fused else 'mlx-lm layer'} | {cells} |")


if __name__ == "__main__":
    main()
