"""The pieces this pass fused, alone, MLX's ops against the kernel nodes, paired in one process.

A depth-1 cycle's greedy verdict and what a queued cycle takes from it (``verify``'s
``mx_verify_greedy`` then ``queue_draft``'s reshape, subtraction, addition and the next
cycle's take, against ``greedy_verdict`` + ``verdict_counts``), and the greedy draft over
the head's 8,192-entry vocabulary with its q (argmax, take and the one-hot's scatter,
against ``greedy_draft`` and q from the token), on evaluated random logits (the default
model's 49,152 and 8,192 widths). Each repeat builds the graph (this thread's CPU time) and
evaluates the ints (``mx.eval``; q is built, never evaluated, as in a pipelined cycle):
blocks of repeats turn about, the order rotating. The draft is rejected (random logits; the
kernel then skips the argmax after it), or with ``--accept`` accepted (both argmaxes).
Prints the medians over blocks of the per-repeat microseconds, and the ratios paired per
block, with the load.

    python benchmarks/results/2026-12-03-mtp-cycle-4/verdict_ab.py [--blocks 40] [--accept]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cycle_ab  # noqa: F401  (first: it imports mtplx, which routes BLAS before MLX loads)
import mlx.core as mx
import numpy as np

from mtplx import fused_layer
from mtplx.sampling import mx_verify_greedy

rng = np.random.default_rng(0)
LOGITS = mx.array(rng.standard_normal((2, 49152)).astype(np.float32))
HEAD = mx.array(rng.standard_normal((1, 1, 8192)).astype(np.float32))
VOCAB = mx.array(rng.permutation(49152)[:8192].astype(np.int32))
IDS = mx.arange(49152, dtype=mx.int32)
mx.eval(LOGITS, HEAD, VOCAB, IDS)


def old() -> list[mx.array]:
    logits = HEAD.reshape(-1)
    index = mx.argmax(logits.astype(mx.float32))
    token = VOCAB[index].astype(mx.int32)
    small = (mx.arange(8192) == mx.argmax(logits[None], axis=-1, keepdims=True)).astype(mx.float32)
    q = mx.zeros((49152,), mx.float32)
    q[VOCAB] = small[0]
    drafts = mx.stack([token])
    num_accepted, output_tokens = mx_verify_greedy(LOGITS[None], drafts[None])
    accepted = num_accepted.reshape(())
    rejected = 1 - accepted
    valid, tokens = accepted + 1, output_tokens.reshape(-1)
    last = mx.take(output_tokens.reshape(-1), num_accepted)
    return [rejected, valid, tokens, last]


def new() -> list[mx.array]:
    logits = HEAD.reshape(-1)
    token = fused_layer.greedy_draft(logits, VOCAB)
    q = (token == IDS).astype(mx.float32)  # noqa: F841  (built, not evaluated)
    drafts = mx.stack([token])
    num_accepted, output_tokens = fused_layer.greedy_verdict(LOGITS, drafts)
    rejected, valid, tokens, last = fused_layer.verdict_counts(num_accepted, output_tokens)
    return [rejected, valid, tokens, last]


def block(fn: Callable[[], list[mx.array]], repeats: int) -> tuple[float, float, float]:
    build, proc, wall = [], [], []
    for _ in range(repeats):
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        out = fn()
        build.append(time.thread_time() - t)
        mx.eval(out)
        proc.append(time.process_time() - p)
        wall.append(time.perf_counter() - w)
    return tuple(1e6 * statistics.median(x) for x in (build, proc, wall))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--accept", action="store_true", help="the draft is accepted")
    args = parser.parse_args()
    if args.accept:  # the target's argmax at the draft's position is the draft
        global LOGITS
        draft = int(np.array(VOCAB)[int(np.argmax(np.array(HEAD)))])
        logits = np.array(LOGITS)
        logits[0, draft] = 100.0
        LOGITS = mx.array(logits)
        mx.eval(LOGITS)
    for a, b in zip(old(), new(), strict=True):  # the same ints
        assert np.array_equal(np.array(a), np.array(b))
    print(f"draft accepted: {int(np.array(new()[1])) == 2}")
    print(f"load before: {os.getloadavg()}")
    results: dict[str, list[tuple[float, float, float]]] = {"MLX ops": [], "kernel nodes": []}
    kinds = [("MLX ops", old), ("kernel nodes", new)]
    for r in range(args.blocks):
        for name, fn in kinds[r % 2 :] + kinds[: r % 2]:
            results[name].append(block(fn, args.repeats))
    print(f"load after: {os.getloadavg()}")
    print("| per repeat, median over blocks | build: thread CPU us | process CPU us | wall us |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.1f}" for i in range(3))
        print(f"| {name} | {cells} |")
    pairs = list(zip(results["kernel nodes"], results["MLX ops"], strict=True))
    cells = " | ".join(f"{statistics.median(n[i] / o[i] for n, o in pairs):.3f}" for i in range(3))
    print(f"| kernel nodes / MLX ops, paired per block | {cells} |")


if __name__ == "__main__":
    main()
