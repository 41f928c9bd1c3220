"""Paired, in-process A/B of a prompt chunk's forward with the trunk's layers as one graph
node each against five, on the default model: a fresh row fed ``--tokens`` tokens in one
forward (the KV written, no logits), evaluated; the two settings turn about, which one goes
first alternating every round. Prints the medians of wall and process-CPU milliseconds a
forward, the one-node / five-node ratios paired per round, and the load average.

    python benchmarks/results/2026-12-03-layer-node/prefill_ab.py [--rounds 10] [--tokens 384]
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

from mtplx import fused_layer  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import activations_format  # noqa: E402
from mtplx.models.slot_target import SlotTarget  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=384)
    args = parser.parse_args()
    target = SlotTarget(load(ensure_default_model("native")).target, max_rows=2)
    assert target.fuses_layers
    tokens = mx.array([(7 + 13 * j * j) % 30000 + 3 for j in range(args.tokens)], mx.int32)

    def forward() -> tuple[float, float]:
        row = target.new_row()
        w, p = time.perf_counter(), time.process_time()
        mx.eval(target.forward([row], [tokens], "none")[0].hidden)
        out = (time.perf_counter() - w, time.process_time() - p)
        target.release(row)
        return out

    for setting in (True, False):  # warm both
        target.layer_node = setting
        forward()
    print(f"activations: {activations_format()}; tokens {args.tokens}")
    print(f"load before: {os.getloadavg()}")
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for setting in (True, False) if r % 2 == 0 else (False, True):
            target.layer_node = setting
            runs[setting].append(forward())
    print(f"load after: {os.getloadavg()}")
    print("| a forward, median | wall ms | process CPU ms |")
    print("|---|---|---|")
    for setting, label in ((True, "one node"), (False, "five nodes")):
        cells = " | ".join(
            f"{1e3 * statistics.median(x[i] for x in runs[setting]):.1f}" for i in (0, 1)
        )
        print(f"| {label} | {cells} |")
    pairs = list(zip(runs[True], runs[False], strict=True))
    ratios = " | ".join(f"{statistics.median(a[i] / b[i] for a, b in pairs):.3f}" for i in (0, 1))
    print(f"| one node / five, paired (median) | {ratios} |")
    print("process-CPU ratios per round:", " ".join(f"{a[1] / b[1]:.3f}" for a, b in pairs))
    print(f"KV stores copied: {fused_layer.store_copies()}")


if __name__ == "__main__":
    main()
