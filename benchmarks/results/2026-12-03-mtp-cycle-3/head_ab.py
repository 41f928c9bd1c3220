"""A steady depth-1 head step alone, before and after this change, in one process.

The engine runs a depth-1 MTP request to its steady state; then its drafter's feed of a
cycle (2 pairs, the last batch's valid count lazy, as ``commit_lazy`` queues them) is
proposed (its graph built: the engine thread's CPU time) and evaluated synchronously
(``mx.eval`` of the draft and the head's cache),
turn about with the drafter's and fused head's code at ``--before`` (``cycle_ab.Switch``),
the cache rolled back after each. Prints the graph nodes of each step and the median and
20th-percentile wall and process-CPU milliseconds.

    python benchmarks/results/2026-12-03-mtp-cycle-3/head_ab.py [--repeats 400]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


import cycle_ab  # first: it imports mtplx, which routes BLAS before MLX loads
import mlx.core as mx

from mtplx.drafters import mtp
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.quantized import activations_format


def _steady_drafter(engine: Engine) -> tuple[Any, Any]:
    """A drafter and its sampler in a steady state (the 10th step of a depth-1 request)."""
    seen: list[tuple[Any, Any]] = []
    original = mtp.MTPDrafter.propose_batch

    def grab(self: Any, drafters: Any, histories: Any, ks: Any, samplers: Any) -> Any:
        seen.append((self, samplers[0]))
        return original(self, drafters, histories, ks, samplers)

    mtp.MTPDrafter.propose_batch = grab  # type: ignore[method-assign]
    try:
        cycle_ab._add(engine, "mtp", 1, 1000)
        for _ in range(10):
            engine.step()
    finally:
        mtp.MTPDrafter.propose_batch = original  # type: ignore[method-assign]
    return seen[-1]


def _step(drafter: Any, sampler: Any, hidden: mx.array, tokens: mx.array) -> list[mx.array]:
    """One feed of 2 pairs (valid count lazy) -> what evaluating the step computes."""
    drafter.checkpoint = None
    drafter.pending_hidden, drafter.pending_tokens = [hidden], [tokens]
    drafter.pending_valid = mx.array(3, mx.int32) - 1  # lazy, as a verdict's count is
    ((token,), _), *_ = mtp.MTPDrafter.propose_batch(drafter, [drafter], [[0]], [1], [sampler])
    return [token, drafter.cache[0].keys, drafter.cache[0].values, drafter.cache[0].offset]


def _nodes(arrays: list[mx.array]) -> int:
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return sum(
        collections.Counter(
            re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue())
        ).values()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--before", default="38327e3")
    args = parser.parse_args()
    switch = cycle_ab.Switch(args.before)
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    drafter, sampler = _steady_drafter(engine)
    saved = (drafter.checkpoint, drafter.num_fed_unsettled)
    cache = drafter.cache[0]
    mx.eval(cache.offset)
    point = cache.checkpoint()
    hidden = mx.random.normal((1, 2, engine.model.target.trunk.hidden_size))
    tokens = mx.array([17, 42], mx.int32)
    mx.eval(hidden, tokens)
    print(f"activations: {activations_format()}; load before: {os.getloadavg()}")
    times: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
    for i in range(args.repeats):
        for code in ("before", "after") if i % 2 else ("after", "before"):
            switch.set(code, [drafter.head])
            built = time.thread_time()
            outputs = _step(drafter, sampler, hidden, tokens)
            built = time.thread_time() - built
            if i == 0:
                print(f"{code}: {_nodes(outputs)} graph nodes a head step")
            w, p = time.perf_counter(), time.process_time()
            mx.eval(outputs)
            times[code].append((time.perf_counter() - w, time.process_time() - p, built))
            cache.rollback(point)
            drafter.num_fed_unsettled -= 1
    switch.set("after", [drafter.head])
    drafter.checkpoint, drafter.num_fed_unsettled = saved
    print(f"load after: {os.getloadavg()}")
    print(
        "| head step (evaluated) | wall ms median | wall ms 20th pct"
        " | CPU ms median | CPU ms 20th pct | build: thread CPU ms median |"
    )
    print("|---|---|---|---|---|---|")
    for code, runs in times.items():
        cells = []
        for k in (0, 1):
            xs = sorted(1e3 * r[k] for r in runs)
            cells += [f"{statistics.median(xs):.3f}", f"{xs[len(xs) // 5]:.3f}"]
        cells.append(f"{statistics.median(1e3 * r[2] for r in runs):.3f}")
        print(f"| {code} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
