"""Where the engine thread's CPU goes in steady steps: ``cProfile`` on thread CPU time
(``time.thread_time``) over the steps of greedy requests, plain and depth-1 MTP, on the
default model; prints each one's top functions by own time and cumulative time, per step.

    python benchmarks/results/2026-12-03-mtp-cycle-4/engine_profile.py [--requests 4]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cycle_ab  # first: it imports mtplx, which routes BLAS before MLX loads

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    for drafter, depth in (("none", 0), ("mtp", 1)):
        profile = cProfile.Profile(time.thread_time)
        steps = 0
        for _ in range(args.requests):
            cycle_ab.add(engine, drafter, depth, args.tokens)
            engine.step()  # the prompt
            for _ in range(2):
                engine.step()
            while engine.running:
                profile.enable()
                engine.step()
                profile.disable()
                steps += 1
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        total = stats.total_tt  # type: ignore[attr-defined]
        print(f"== {drafter}@{depth}: {steps} steps, {1e3 * total / steps:.3f} ms a step")
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
