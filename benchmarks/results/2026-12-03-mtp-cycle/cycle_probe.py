"""Where a depth-1 MTP cycle's extra time goes against a plain step, on the default model.

One process, one loaded model, one engine (the process's ``MTPLX_ACTIVATIONS`` mode):

- ``--nodes``: the graph nodes each engine step hands MLX (``mx.async_eval`` / ``mx.eval``
  wrapped; ``mx.export_to_dot`` of their arguments, primitives counted by name), for a
  plain step and a depth-1 cycle in their steady state;
- ``--profile``: cProfile of the engine thread over a 64-token run of each (top functions by
  own time);
- always: paired rounds, turn about: the median wall, process-CPU and engine-thread-CPU
  milliseconds of a step (the first two after the prompt left out) and the cycle / plain
  ratios paired per round, with the load average.

    python benchmarks/results/2026-12-03-mtp-cycle/cycle_probe.py [--rounds 6] [--nodes] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import activations_format  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

PROMPT = "Explain why the sky is blue in two sentences."
KINDS = [("plain", "none", 0), ("mtp@1", "mtp", 1)]


def _add(engine: Engine, drafter: str, depth: int, tokens: int) -> None:
    ids = list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )
    )
    engine.add(
        GenerationRequest(
            prompt_ids=ids,
            sampler=SamplerConfig(temperature=0.0),
            max_tokens=tokens,
            ignore_eos=True,
            drafter=drafter,
            depth=depth,
        )
    )


def _run(engine: Engine, drafter: str, depth: int, tokens: int) -> tuple[float, ...]:
    _add(engine, drafter, depth, tokens)
    engine.step()  # the prompt
    wall, proc, thread = [], [], []
    steps = 0
    while engine.running:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        proc.append(time.process_time() - p)
        thread.append(time.thread_time() - t)
        steps += 1
    medians = [1e3 * statistics.median(x[2:]) for x in (wall, proc, thread)]
    return (*medians, steps)


def _nodes(engine: Engine, drafter: str, depth: int) -> collections.Counter:
    """Primitive counts of what one steady-state step evaluates (the 6th step)."""
    counts: collections.Counter = collections.Counter()
    recording = [False]
    originals = (mx.async_eval, mx.eval)

    def wrap(fn):  # type: ignore[no-untyped-def]
        def wrapped(*args):  # type: ignore[no-untyped-def]
            if recording[0]:
                leaves = [a for a in _flatten(args)]
                if leaves:
                    out = io.StringIO()
                    mx.export_to_dot(out, *leaves)
                    counts.update(re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()))
            return fn(*args)

        return wrapped

    mx.async_eval, mx.eval = wrap(originals[0]), wrap(originals[1])
    try:
        _add(engine, drafter, depth, 24)
        for step in range(12):
            recording[0] = step == 6
            engine.step()
        recording[0] = False
        while engine.running:
            engine.step()
    finally:
        mx.async_eval, mx.eval = originals
    return counts


def _flatten(tree):  # type: ignore[no-untyped-def]
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, list | tuple):
        for t in tree:
            yield from _flatten(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _flatten(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--nodes", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    print(f"activations: {activations_format()}")
    if args.nodes:
        for name, drafter, depth in KINDS:
            counts = _nodes(engine, drafter, depth)
            print(f"{name}: {sum(counts.values())} nodes: {dict(counts.most_common())}")
    if args.profile:
        for name, drafter, depth in KINDS:
            profiler = cProfile.Profile()
            _add(engine, drafter, depth, args.tokens)
            engine.step()
            profiler.enable()
            while engine.running:
                engine.step()
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            print(f"== {name}\n{out.getvalue()}")
    print(f"load before: {os.getloadavg()}")
    results: dict[str, list[tuple[float, ...]]] = {k[0]: [] for k in KINDS}
    for r in range(args.rounds):
        for name, drafter, depth in KINDS[r % 2 :] + KINDS[: r % 2]:
            results[name].append(_run(engine, drafter, depth, args.tokens))
    print(f"load after: {os.getloadavg()}")
    print("| per step (median over rounds) | wall ms | process CPU ms | engine thread CPU ms |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(3))
        print(f"| {name} | {cells} |")
    pairs = list(zip(results["mtp@1"], results["plain"], strict=True))
    print(
        "cycle / plain, paired per round (medians): "
        f"wall {statistics.median(m[0] / p[0] for m, p in pairs):.3f}, "
        f"process CPU {statistics.median(m[1] / p[1] for m, p in pairs):.3f}, "
        f"tokens per step mtp@1 {statistics.median(args.tokens / m[3] for m, _ in pairs):.2f}"
    )


if __name__ == "__main__":
    main()
