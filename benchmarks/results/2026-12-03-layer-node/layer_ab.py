"""Paired, in-process A/B of the trunk's layers as one graph node each against five, on the
default model.

One process, one loaded model, one engine (the process's ``MTPLX_ACTIVATIONS`` mode); the
switch is the engine's target's ``layer_node`` (``MTPLX_LAYER_NODE``). Per kind of run --
plain decoding or depth-1 MTP cycles, 1 stream or 16 greedy streams at once -- the two
settings turn about, which one goes first alternating every round. Per run: the median wall,
process-CPU and engine-thread-CPU milliseconds of an engine step (the first two after the
prompts left out); then the medians over rounds, and the one-node / five-node ratios paired
per round, with the load average. Also: the graph nodes one steady step hands MLX (every
``mx.async_eval`` / ``mx.eval`` of its 7th step, ``mx.export_to_dot``), and the KV stores
copied rather than written in place over the timed runs (``fused_layer.store_copies``).

    python benchmarks/results/2026-12-03-layer-node/layer_ab.py [--rounds 6] [--tokens 48]
    python benchmarks/results/2026-12-03-layer-node/layer_ab.py --rounds 0  # nodes only
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from mtplx import fused_layer  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import activations_format  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402
from mtplx.sequence import Status  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
    "What is the capital of France? Answer briefly.",
]


def _add(engine: Engine, drafter: str, depth: int, tokens: int, streams: int) -> None:
    for i in range(streams):
        prompt = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        ids = list(
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
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


def _run(engine: Engine, kind: tuple[str, int, int], tokens: int) -> tuple[float, ...]:
    drafter, depth, streams = kind
    _add(engine, drafter, depth, tokens, streams)
    while any(s.status is Status.PREFILLING for s in engine.running):
        engine.step()  # the prompts
    wall, proc, thread = [], [], []
    while engine.running:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        proc.append(time.process_time() - p)
        thread.append(time.thread_time() - t)
    return tuple(1e3 * statistics.median(x[2:]) for x in (wall, proc, thread))


def _leaves(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, list | tuple):
        return [leaf for t in tree for leaf in _leaves(t)]
    if isinstance(tree, dict):
        return [leaf for t in tree.values() for leaf in _leaves(t)]
    return []


def _nodes(engine: Engine, kind: tuple[str, int, int]) -> collections.Counter[str]:
    """The primitives of every graph the 7th step of a run hands MLX, counted."""
    dots: list[str] = []
    recording = [False]
    originals = (mx.async_eval, mx.eval)

    def wrap(fn: Any) -> Any:
        def wrapped(*arrays: Any) -> Any:
            if recording[0] and (leaves := _leaves(arrays)):
                out = io.StringIO()
                mx.export_to_dot(out, *leaves)
                dots.append(out.getvalue())
            return fn(*arrays)

        return wrapped

    mx.async_eval, mx.eval = wrap(originals[0]), wrap(originals[1])
    try:
        _add(engine, kind[0], kind[1], 24, kind[2])
        for step in range(12):
            recording[0] = step == 6
            engine.step()
        recording[0] = False
        while engine.running:
            engine.step()
    finally:
        mx.async_eval, mx.eval = originals
    return collections.Counter(
        label for d in dots for label in re.findall(r'label ="([^"]+)", shape=rectangle', d)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--kinds", default="plain1,mtp1,plain16,mtp16")
    parser.add_argument("--no-nodes", action="store_true")
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model("native")))
    target: Any = engine.batched
    assert target.fuses_layers, "the fused layers do not serve here"
    engine.warm_up()
    all_kinds = {
        "plain1": ("none", 0, 1),
        "mtp1": ("mtp", 1, 1),
        "plain16": ("none", 0, 16),
        "mtp16": ("mtp", 1, 16),
    }
    kinds = {name: all_kinds[name] for name in args.kinds.split(",")}
    print(f"activations: {activations_format()}; cpus: {os.cpu_count()}")
    if not args.no_nodes:
        for name in ("plain1", "mtp1"):
            for setting in (True, False):
                target.layer_node = setting
                counts = _nodes(engine, all_kinds[name])
                label = "one node" if setting else "five nodes"
                print(f"{name} {label}: {sum(counts.values())} nodes: {dict(counts.most_common())}")
        target.layer_node = True
    if args.rounds == 0:
        return
    print(f"load before: {os.getloadavg()}")
    results: dict[tuple[str, bool], list[tuple[float, ...]]] = {}
    copies: dict[bool, int] = {True: 0, False: 0}
    for r in range(args.rounds):
        for name, kind in kinds.items():
            order = (True, False) if r % 2 == 0 else (False, True)
            for setting in order:
                target.layer_node = setting
                before = fused_layer.store_copies()
                results.setdefault((name, setting), []).append(_run(engine, kind, args.tokens))
                copies[setting] += fused_layer.store_copies() - before
        print(f"round {r} done, load {os.getloadavg()}", flush=True)
    target.layer_node = True
    print(f"load after: {os.getloadavg()}")
    print(f"KV stores copied over the timed runs: one node {copies[True]}, five {copies[False]}")
    print("| per step, median over rounds | wall ms | process CPU ms | engine thread CPU ms |")
    print("|---|---|---|---|")
    for (name, setting), runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(3))
        print(f"| {name} {'one node' if setting else 'five nodes'} | {cells} |")
    print("| one node / five, paired per round (median) | wall | process CPU | engine thread CPU |")
    print("|---|---|---|---|")
    for name in kinds:
        pairs = list(zip(results[(name, True)], results[(name, False)], strict=True))
        cells = " | ".join(
            f"{statistics.median(a[i] / b[i] for a, b in pairs):.3f}" for i in range(3)
        )
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
