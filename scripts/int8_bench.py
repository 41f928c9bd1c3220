"""The quantized products of the default model, float mode against the integer-dot mode.

Each product shape of SmolLM2-135M (qkv, o, gate/up, down: 4-bit group 32; the tied LM
head: 8-bit group 32; float16 scales and biases as the GGUF's) at 1, 2, 4, 16 and 384 rows,
both modes called through the C entries (``mtplx_qmm``, ``mtplx_qmm_int8``) on one thread,
A/B interleaved in one process; CPU time of the calling thread (``time.thread_time``),
median of repeats. Prints a markdown table and the load average before and after.

    python scripts/int8_bench.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

import mtplx  # noqa: F401  (enables the BLAS shim before MLX loads)
from mtplx import quant

# (name, N, K, bits): one layer's products and the LM head.
SHAPES = [
    ("qkv 960x576", 960, 576, 4),
    ("o 576x576", 576, 576, 4),
    ("gate/up 3072x576", 3072, 576, 4),
    ("down 576x1536", 576, 1536, 4),
    ("LM head 49152x576 (8-bit)", 49152, 576, 8),
]
ROWS = (1, 2, 4, 16, 384)
GROUP = 32


def _weights(n: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import mlx.core as mx  # after mtplx: the BLAS shim comes first

    rng = np.random.default_rng(n + k + bits)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    packed, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
    return (
        np.array(packed),
        np.array(scales.astype(mx.float16)).view(np.uint16),
        np.array(biases.astype(mx.float16)).view(np.uint16),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ext = quant.load_extension()
    quant.set_threads(1)
    lib = ctypes.CDLL(ext.__file__)
    ptr = ctypes.c_void_p
    entries = {"float32": lib.mtplx_qmm, "int8": lib.mtplx_qmm_int8}
    for fn in entries.values():
        fn.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
        fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int
    print(f"kernel: {quant.quant_info().kernel}; load before: {os.getloadavg()}")
    print("| product | rows | float32 ms | int8 ms | speed-up |")
    print("|---|---|---|---|---|")
    totals = {1: [0.0, 0.0]}
    for name, n, k, bits in SHAPES:
        packed, scales, biases = _weights(n, k, bits)
        for rows in ROWS:
            x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
            y = np.zeros((rows, n), np.float32)
            calls = max(1, int(2e7 // (n * k * rows)))  # ~>1 ms of work a sample
            times: dict[str, list[float]] = {mode: [] for mode in entries}
            for _ in range(args.repeats):
                for mode, fn in entries.items():
                    start = time.thread_time()
                    for _ in range(calls):
                        status = fn(
                            x.ctypes.data, rows, k, packed.ctypes.data, scales.ctypes.data,
                            biases.ctypes.data, 1, n, bits, GROUP, y.ctypes.data,
                        )  # fmt: skip
                        assert status == 0
                    times[mode].append(1e3 * (time.thread_time() - start) / calls)
            f, i = statistics.median(times["float32"]), statistics.median(times["int8"])
            if rows == 1:
                per_token = 30 if not name.startswith("LM") else 1
                totals[1][0] += per_token * f * (2 if name.startswith("gate") else 1)
                totals[1][1] += per_token * i * (2 if name.startswith("gate") else 1)
            print(f"| {name} | {rows} | {f:.3f} | {i:.3f} | {f / i:.2f}x |")
    f, i = totals[1]
    print(f"one token's products (30 layers + LM head, 1 row): float32 {f:.2f} ms, int8 {i:.2f} ms,"
          f" {f / i:.2f}x")  # fmt: skip
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
