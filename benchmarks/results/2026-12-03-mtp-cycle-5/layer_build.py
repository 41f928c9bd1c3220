"""The engine thread's CPU to build one trunk layer node (graph building only, nothing
evaluated), default-model shapes with random Q4 weights, one row: ``fused_layer.layer``
given plain ``LayerWeights`` and ``GroupWrite``s ("wrapper"), given them prepared
(``prepare``, ``group_args``: as the trunk and the head call it), and the extension's
``layer_step`` called with the arguments built beforehand ("direct"). Blocks of 300 calls
turn about, 30 blocks, the order rotating; medians."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: F401
import mlx.core as mx

from mtplx import fused_layer
from mtplx.models.quantized import QuantWeight
from mtplx.quant import load_extension


def _weight(n: int, k: int) -> QuantWeight:
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=32, bits=4)
    mx.eval(w, s, b)
    return QuantWeight(w, s, b, 4, 32)


def _ints(values: list[int]) -> mx.array:
    return mx.array(values, mx.int32)


def main() -> None:
    size, heads, kv, d, inner = 576, 9, 3, 64, 1536
    w = fused_layer.LayerWeights(
        mx.ones((size,)), _weight((heads + 2 * kv) * d, size), heads, kv, d, d, 1e-5, 0.125,
        _weight(size, heads * d), mx.ones((size,)), _weight(2 * inner, size),
        _weight(size, inner), 1e-5,
    )  # fmt: skip
    x = mx.random.normal((1, 1, size))
    cos, sin = mx.ones((1, d // 2)), mx.zeros((1, d // 2))
    keys, values = mx.zeros((1, kv, 256, d)), mx.zeros((1, kv, 256, d + 1))
    g = fused_layer.GroupWrite(0, 0, 1, _ints([0, 256, 512]), _ints([0]), 1, _ints([0]), _ints([1]))
    mx.eval(x, cos, sin, keys, values, g.write_at, g.to_padded, g.slots, g.counts)
    ext = load_extension()
    prepared, groups = fused_layer.prepare(w), fused_layer.group_args([g])

    def wrapper() -> object:
        return fused_layer.layer(x, w, cos, sin, [(keys, values)], [g], True)

    def with_prepared() -> object:
        return fused_layer.layer(x, prepared, cos, sin, [(keys, values)], groups, True)

    def direct() -> object:
        return ext.layer_step(
            x, *prepared.before, cos, sin, *prepared.after, True, [keys, values],
            groups.arrays, groups.meta,
        )  # fmt: skip

    def block(f: Callable[[], object], n: int = 300) -> float:
        t = time.thread_time()
        for _ in range(n):
            f()
        return (time.thread_time() - t) / n * 1e6

    kinds = [("wrapper", wrapper), ("prepared", with_prepared), ("direct", direct)]
    res: dict[str, list[float]] = {name: [] for name, _ in kinds}
    print("load", os.getloadavg())
    for r in range(30):
        for name, f in kinds[r % 3 :] + kinds[: r % 3]:
            res[name].append(block(f))
    for name, v in res.items():
        print(name, f"{statistics.median(v):.2f} us a call (thread CPU)")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
