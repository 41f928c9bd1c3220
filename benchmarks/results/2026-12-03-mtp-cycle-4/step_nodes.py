"""The graph nodes one steady engine step hands MLX, counted by primitive, on the default model.

Runs a 24-token request (plain, or ``mtp`` at a depth) and records, at its 7th step, what
every ``mx.async_eval`` / ``mx.eval`` call is given (``mx.export_to_dot``); prints the
primitives' counts, or with ``--dot`` the dot text itself. ``--before`` / ``--switch``: with
those attributes at that revision (``benchmarks/cycle_ab.py``'s switch).

    python benchmarks/results/2026-12-03-mtp-cycle-4/step_nodes.py mtp 1 [--dot]
    python benchmarks/results/2026-12-03-mtp-cycle-4/step_nodes.py none 0
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cycle_ab  # first: it imports mtplx, which routes BLAS before MLX loads
import mlx.core as mx

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model


def _leaves(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, list | tuple):
        return [leaf for t in tree for leaf in _leaves(t)]
    if isinstance(tree, dict):
        return [leaf for t in tree.values() for leaf in _leaves(t)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("depth", type=int)
    parser.add_argument("--dot", action="store_true")
    parser.add_argument("--before", default="HEAD")
    parser.add_argument(
        "--switch", action="append", default=[], help="path:attribute[=path:attribute]"
    )
    args = parser.parse_args()
    cycle_ab.Switch(args.before, args.switch).set("before")
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
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
        cycle_ab.add(engine, args.drafter, args.depth, 24)
        for step in range(12):
            recording[0] = step == 6
            engine.step()
        recording[0] = False
        while engine.running:
            engine.step()
    finally:
        mx.async_eval, mx.eval = originals
    if args.dot:
        print("\n".join(dots))
        return
    counts = collections.Counter(
        label for d in dots for label in re.findall(r'label ="([^"]+)", shape=rectangle', d)
    )
    total = sum(counts.values())
    print(f"{args.drafter}@{args.depth}: {total} nodes: {dict(counts.most_common())}")


if __name__ == "__main__":
    main()
