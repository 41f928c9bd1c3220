"""``verify_rows`` over B greedy rows, paired in one process: the rows together with MLX's
ops (``_verify_argmax_rows``, what ``verify_rows`` ran before) against a verdict node a row
(``verify``, what it runs with the kernel). Each repeat builds the verdicts of B rows of
depth k over evaluated random logits [k+1, 49,152] (drafts matching the argmax for a random
prefix, the same ints checked) and evaluates them; blocks of repeats turn about, the order
alternating. Per block: the graph building's thread CPU and the evaluated process CPU and
wall, per repeat.

    python benchmarks/results/2026-12-03-mtp-cycle-5/verify_rows_ab.py --rows 4 --depth 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: F401
import mlx.core as mx
import numpy as np

from mtplx.cycle import Draft
from mtplx.models.rows import RowOutput
from mtplx.sampling import SamplerConfig
from mtplx.speculative import _verify_argmax_rows, verify

VOCAB = 49_152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(args.rows):
        logits = rng.normal(size=(args.depth + 1, VOCAB)).astype(np.float32)
        greedy = logits.argmax(-1)
        right = int(rng.integers(0, args.depth + 1))
        tokens = [int(greedy[j]) if j < right else 7 for j in range(args.depth)]
        sequence = types.SimpleNamespace(
            config=SamplerConfig(temperature=0.0), token_counts=None, grammar=None
        )
        draft = Draft(mx.array(tokens, mx.int32), [], mx.zeros((1,)), args.depth, 0.0)
        rows.append((sequence, draft, RowOutput(mx.array(logits), mx.zeros((1, 4)))))
    mx.eval([row[2].logits for row in rows], [row[1].tokens for row in rows])

    def together() -> list[tuple[mx.array, mx.array]]:
        return _verify_argmax_rows([r[1] for r in rows], [r[2] for r in rows])

    def nodes() -> list[tuple[mx.array, mx.array]]:
        return [verify(*row) for row in rows]  # type: ignore[arg-type]

    want, got = together(), nodes()
    for (a, t), (b, u) in zip(want, got, strict=True):
        assert a.tolist() == b.tolist() and t.tolist() == u.tolist()
    kinds = {"MLX ops, rows together": together, "a verdict node a row": nodes}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    print(f"rows {args.rows}, depth {args.depth}; load before {os.getloadavg()}")
    for block in range(args.blocks):
        order = list(kinds) if block % 2 else list(kinds)[::-1]
        for name in order:
            build = proc = wall = 0.0
            for _ in range(args.repeats):
                w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
                out = kinds[name]()
                build += time.thread_time() - t
                mx.eval(out)
                proc += time.process_time() - p
                wall += time.perf_counter() - w
            results[name].append(
                tuple(1e6 * x / args.repeats for x in (build, proc, wall))  # type: ignore[arg-type]
            )
    print(f"load after {os.getloadavg()}")
    print("| per repeat, median over blocks | build: thread CPU us | process CPU us | wall us |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.1f}" for i in range(3))
        print(f"| {name} | {cells} |")
    a, b = results["a verdict node a row"], results["MLX ops, rows together"]
    cells = " | ".join(
        f"{statistics.median(x[i] / y[i] for x, y in zip(a, b, strict=True)):.3f}" for i in range(3)
    )
    print(f"| node a row / together, paired per block | {cells} |")


if __name__ == "__main__":
    main()
