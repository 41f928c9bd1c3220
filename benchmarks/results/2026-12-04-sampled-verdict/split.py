"""Where a sampled depth-1 verify's time goes, and what the kernel nodes take instead: the
sampled path's pieces over [2, 49152] (the default model's vocabulary, T = 0.6), each
evaluated alone on evaluated inputs, the median of REPEATS, wall and process CPU; the
pieces run turn about (round robin), so a load change hits them alike.

    python benchmarks/results/2026-12-04-sampled-verdict/split.py [repeats]
"""

from __future__ import annotations

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)

import os
import statistics
import sys
import time

import mtplx  # noqa: F401  (routes BLAS before MLX loads)
import mlx.core as mx
import numpy as np

from mtplx import sampling
from mtplx.sampling import (
    SamplerConfig,
    mx_distribution_from_logits,
    mx_sample,
    mx_verify_draft_tokens,
)

V, N = 49152, 2
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
rng = np.random.default_rng(0)
logits = mx.array((rng.standard_normal((N, V)) * 4).astype(np.float32))
config = SamplerConfig(temperature=0.6)
q = mx.array(rng.dirichlet(np.ones(V)).astype(np.float32))
drafts = mx.array([int(rng.integers(V))], mx.int32)
uniforms = mx.array([0.2, 0.5, 0.3], mx.float32)
shifted = logits - mx.max(logits, axis=-1, keepdims=True)
scaled = shifted / 0.6
probs = mx_distribution_from_logits(logits, config)
mx.eval(logits, q, drafts, uniforms, shifted, scaled, probs)
kernel = sampling.sampling_kernel()
assert kernel is not None


def mlx_verdict() -> tuple[mx.array, mx.array]:
    return mx_verify_draft_tokens(
        probs[None], q[None, None], drafts[None], uniforms[1:2][None], uniforms[2:]
    )


PIECES = {
    "MLX: max + subtract": lambda: logits - mx.max(logits, axis=-1, keepdims=True),
    "MLX: divide by T": lambda: shifted / 0.6,
    "MLX: softmax(precise) [2, V]": lambda: mx.softmax(scaled, axis=-1, precise=True),
    "MLX: exp alone [2, V]": lambda: mx.exp(scaled),
    "MLX: distribution (5 ops) [2, V]": lambda: mx_distribution_from_logits(logits, config),
    "MLX: cumsum [1, V]": lambda: mx.cumsum(probs[:1], axis=-1),
    "MLX: mx_sample [1, V]": lambda: mx_sample(probs[:1], uniforms[:1]),
    "MLX: verdict ops on p (mx_verify_draft_tokens)": mlx_verdict,
    "MLX: distribution + verdict (the old verify)": lambda: mx_verify_draft_tokens(
        mx_distribution_from_logits(logits, config)[None],
        q[None, None],
        drafts[None],
        uniforms[1:2][None],
        uniforms[2:],
    ),
    "MLX: plain draw (distribution + mx_sample) [1, V]": lambda: mx_sample(
        mx_distribution_from_logits(logits[:1], config), uniforms[:1]
    ),
    "MLX: filters top_k 20, top_p 0.95 on p [2, V] (bench's t0.6)": lambda: (
        sampling.mx_apply_top_p_top_k(probs, 0.95, 20, 0.0)
    ),
    "MLX: filter top_p 0.95 alone on p [2, V] (a full sort)": lambda: sampling.mx_apply_top_p_top_k(
        probs, 0.95, 0, 0.0
    ),
    "C: distribution node [2, V]": lambda: kernel.sampled_distribution(logits, 0.6),
    "C: distribution node with top_k 20, top_p 0.95 [2, V]": lambda: kernel.sampled_distribution(
        logits, 0.6, 20, 0.95
    ),
    "C: distribution node with top_p 0.95 alone [2, V]": lambda: kernel.sampled_distribution(
        logits, 0.6, 0, 0.95
    ),
    "C: draw node on p [1, V]": lambda: kernel.sampled_draw(probs[:1], uniforms[:1]),
    "C: plain draw (distribution + draw nodes) [1, V]": lambda: kernel.sampled_draw(
        kernel.sampled_distribution(logits[:1], 0.6), uniforms[:1]
    ),
    "C: verdict node from logits, accepted (2 rows of p)": lambda: kernel.sampled_verdict(
        logits, mx.argmax(logits[:1], axis=-1).astype(mx.int32), uniforms, [q * 0 + 1e-9], 0.6, 1, 2
    ),
    "C: verdict node from logits, rejected (1 row of p)": lambda: kernel.sampled_verdict(
        logits, drafts, mx.array([0.2, 0.9999, 0.3]), [q], 0.6, 1, 2
    ),
    "C: verify at bench's t0.6 (distribution node with filters, verdict node on p)": lambda: (
        kernel.sampled_verdict(
            kernel.sampled_distribution(logits, 0.6, 20, 0.95),
            drafts,
            mx.array([0.2, 0.9999, 0.3]),
            [q],
            0.0,
            1,
            2,
        )
    ),
    "one tiny MLX op (a node's cost)": lambda: uniforms + 1.0,
}


def main() -> None:
    walls: dict[str, list[float]] = {name: [] for name in PIECES}
    cpus: dict[str, list[float]] = {name: [] for name in PIECES}
    print(f"V={V} rows={N} repeats={REPEATS} load before={os.getloadavg()}")
    for _ in range(REPEATS):
        for name, fn in PIECES.items():
            w, c = time.perf_counter(), time.process_time()
            mx.eval(fn())
            walls[name].append(time.perf_counter() - w)
            cpus[name].append(time.process_time() - c)
    print(f"load after={os.getloadavg()}")
    print("| piece | wall ms (median) | process CPU ms (median) |")
    print("|---|---|---|")
    for name in PIECES:
        wall, cpu = statistics.median(walls[name]) * 1e3, statistics.median(cpus[name]) * 1e3
        print(f"| {name} | {wall:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
