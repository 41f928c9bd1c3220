"""No model: a decode loop of MTPLX's KV write node (``fused_layer.write``'s ``kv_write``)
over ``LAYERS`` stores, pipelined as the engine pipelines plain rows: step j+1 is built on
step j's lazy output and queued (``async_eval``) before step j's output is read. Each layer
is a product (a slow kernel, so the host runs ahead of MLX's CPU stream) and a write of a
slice of it into the layer's store; ``pad`` ``stop_gradient`` nodes (views: no kernel, one
dispatch each) are added to every step. For each pad: the step's dispatches on MLX's CPU
stream (counted from the step's graph: every node one dispatch for the buffers MLX holds
until it has run, every node with a kernel one more, and the eval's synchronizer one) and
the stores the write node copied instead of writing in place.

    python window.py [pads, e.g. 0-12] [steps]
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import mtplx  # noqa: F401

# isort: split
import mlx.core as mx

from mtplx import fused_layer
from mtplx.quant import load_extension

FIRST, LAST = (int(p) for p in (sys.argv[1] if len(sys.argv) > 1 else "0-20").split("-"))
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
LAYERS, WIDTH, CAP = 9, 1024, 256
VIEWS = {"Broadcast", "ExpandDims", "Squeeze", "Reshape", "Slice", "StopGradient"}
ext = load_extension()
weights = [mx.random.normal((WIDTH, WIDTH)) * WIDTH**-0.5 for _ in range(LAYERS)]
mx.eval(weights)


def step(x: mx.array, stores: list[mx.array], position: int, pad: int):  # type: ignore[no-untyped-def]
    """One step's graph: x [1, WIDTH] -> (x, the stores after this step's writes)."""
    at = mx.array([position], mx.int32)
    to_padded = mx.array([0], mx.int32)
    written = []
    for w, store in zip(weights, stores, strict=True):
        x = x @ w
        fresh = x[:, :8].reshape(1, 1, 8)
        store = ext.kv_write(store, fresh, at, to_padded, 1)
        # A reader of the written store (the engine's layer node attends over it), so the
        # store is computed with x, as a layer node's stores are (not asked for by name).
        x = x + store[0, 0, :1, :1]
        written.append(store)
    for _ in range(pad):
        x = mx.stop_gradient(x)
    return x, written


def dispatches(read: mx.array) -> int:
    """MLX CPU dispatches of the step's graph (the arrays not yet queued)."""
    with tempfile.TemporaryDirectory() as directory:
        dot = Path(directory) / "step.dot"
        mx.export_to_dot(str(dot), read)
        names = collections.Counter(re.findall(r'label ="(\w+)"', dot.read_text()))
    nodes = sum(names.values())
    return nodes + sum(n for name, n in names.items() if name not in VIEWS) + 1


def run(pad: int) -> tuple[int, int]:
    """(dispatches a step, stores copied over STEPS pipelined steps)."""
    stores = [mx.zeros((1, 1, CAP, 8)) for _ in range(LAYERS)]
    x = mx.random.normal((1, WIDTH))
    mx.eval(stores, x)
    before = fused_layer.store_copies()
    queued = None
    counted = 0
    for position in range(STEPS):
        x, stores = step(x, stores, position % CAP, pad)
        read = x[0, 0]  # what the next step reads of this one (the engine: a row's draw)
        if position == 1:
            counted = dispatches(read)
        mx.async_eval(read)  # not the stores: the eval's own last node would hold them
        if queued is not None:
            queued.item()  # the step before, queued with it (the engine reads the previous draw)
        queued = read
    mx.eval(x, stores)
    return counted, fused_layer.store_copies() - before


def main() -> None:
    print(f"{LAYERS} layers, {STEPS} steps; load {os.getloadavg()}")
    print("pad  dispatches a step  stores copied")
    for pad in range(FIRST, LAST + 1):
        counted, copies = run(pad)
        print(f"{pad:3}  {counted:17}  {copies:13}", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
