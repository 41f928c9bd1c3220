"""The int8 kernel's product of 1 row against 2 (a plain step's against a depth-1 verify's),
for the default model's shapes (random weights: Q4 group 32 layers, the Q8 LM head), each
product evaluated alone; 15 rounds turn about, the order alternating; medians."""

from __future__ import annotations

import os
import statistics
import time

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: F401
import mlx.core as mx

from mtplx.quant import qmm

SHAPES = {
    "qkv": (960, 576, 4, 32),
    "o": (576, 576, 4, 32),
    "gate_up": (3072, 576, 4, 32),
    "down": (576, 1536, 4, 32),
    "lm_head": (49152, 576, 8, 32),
}


def main() -> None:
    weights = {}
    for name, (n, k, bits, group) in SHAPES.items():
        w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=group, bits=bits)
        mx.eval(w, s, b)
        weights[name] = (w, s, b, bits, group, k)
    xs = {(name, m): mx.random.normal((m, weights[name][5])) for name in weights for m in (1, 2)}
    mx.eval(list(xs.values()))

    def run(name: str, m: int, reps: int) -> tuple[float, float]:
        w, s, b, bits, group, _ = weights[name]
        x = xs[(name, m)]
        t, p = time.perf_counter(), time.process_time()
        for _ in range(reps):
            mx.eval(qmm(x, w, s, b, bits, group, "int8"))
        return (time.perf_counter() - t) / reps * 1e6, (time.process_time() - p) / reps * 1e6

    print("load", os.getloadavg())
    for name in weights:
        reps = 20 if name == "lm_head" else 200
        res: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
        for r in range(15):
            for m in (1, 2) if r % 2 else (2, 1):
                res[m].append(run(name, m, reps))
        w1, w2 = (statistics.median(x[0] for x in res[m]) for m in (1, 2))
        c1, c2 = (statistics.median(x[1] for x in res[m]) for m in (1, 2))
        print(
            f"{name}: M=1 {w1:.1f} us wall {c1:.1f} cpu; M=2 {w2:.1f} wall {c2:.1f} cpu; "
            f"ratio wall {w2 / w1:.3f} cpu {c2 / c1:.3f}"
        )
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
