"""Forward and matmul times of a SmolLM2-135M-shaped f32 llama at 1/4/8/16 rows.

Run once per BLAS to compare:

    python -m scripts.bench_blas                       # OpenBLAS + the invariant kernel
    MTPLX_BLAS_INVARIANT=0 python -m scripts.bench_blas  # plain OpenBLAS for every product
    MTPLX_BLAS=reference python -m scripts.bench_blas  # the wheel's reference BLAS

Rows are tokens of one forward: ``--batch`` makes them sequences of one token each (a
continuous-batching decode step), otherwise one sequence's tokens (a verify forward).
``--micro`` times the model's matmuls alone (x[M, 576] @ W.T for each weight shape).
Repeats are interleaved across row counts; each line is min / median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mtplx  # noqa: F401  (enables the fast BLAS before mlx loads)
from mtplx.blas import blas_info, set_blas_threads

import mlx.core as mx  # isort: skip
from mlx_lm.models import cache as cache_lib  # isort: skip
from mlx_lm.models import llama  # isort: skip

HIDDEN, INTERMEDIATE, KV, VOCAB = 576, 1536, 192, 49152
# (K, N) of each weight a token's row meets: q/o, k/v, gate/up, down, lm head.
MATMUL_SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
MATMUL_SHAPES.append((HIDDEN, VOCAB))


def build_model() -> llama.Model:
    """Random-weight float32 llama with SmolLM2-135M's shapes (~135M parameters)."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=30,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_forward(model: llama.Model, rows: list[int], prefix: int, repeats: int, batch: bool):
    """{rows: [ms]} of one forward over ``rows`` new rows after ``prefix`` cached tokens."""
    setups = {}
    for n in rows:
        b, t = (n, 1) if batch else (1, n)
        cache = cache_lib.make_prompt_cache(model)
        mx.eval(model(mx.arange(prefix * b).reshape(b, prefix) % 1000, cache=cache))
        setups[n] = (cache, ((mx.arange(n) + 7) % 1000).reshape(b, t))
    times: dict[int, list[float]] = {n: [] for n in rows}
    for repeat in range(repeats + 1):  # the first round warms up
        for n, (cache, tokens) in setups.items():
            elapsed = _timed(lambda c=cache, x=tokens: mx.eval(model(x, cache=c)))
            for c in cache:  # roll the step back, as the engine does for rejected drafts
                c.trim(tokens.shape[1])
            if repeat:
                times[n].append(elapsed)
    return times


def bench_matmuls(rows: list[int], repeats: int):
    """{(M, K, N): [ms]} of x[M, K] @ W[N, K].T, weights larger than the caches included."""
    weights = {(k, n): mx.random.normal((n, k)) for k, n in MATMUL_SHAPES}
    inputs = {(m, k): mx.random.normal((m, k)) for m in rows for k in (HIDDEN, INTERMEDIATE)}
    mx.eval(list(weights.values()), list(inputs.values()))
    times: dict[tuple[int, int, int], list[float]] = {}
    for repeat in range(repeats + 1):
        for (k, n), w in weights.items():
            for m in rows:
                elapsed = _timed(lambda a=inputs[m, k], b=w: mx.eval(a @ b.T))
                if repeat:
                    times.setdefault((m, k, n), []).append(elapsed)
    return times


def _line(times: list[float]) -> str:
    return f"{min(times):8.2f} {statistics.median(times):8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts")
    parser.add_argument("--prefix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", action="store_true", help="rows are sequences, not tokens")
    parser.add_argument("--micro", action="store_true", help="time the matmuls alone")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.threads:
        set_blas_threads(args.threads)
    info = blas_info()
    print(f"BLAS: {info.name} threads={info.threads} fast={info.fast} (min / median)")
    if args.micro:
        for (m, k, n), times in sorted(bench_matmuls(rows, args.repeats).items()):
            print(f"  x[{m:3d}, {k:4d}] @ W[{n:5d}, {k:4d}].T: {_line(times)}")
        return
    for n, times in bench_forward(
        build_model(), rows, args.prefix, args.repeats, args.batch
    ).items():
        print(f"  {n:3d} {'sequences' if args.batch else 'tokens'}: {_line(times)}")


if __name__ == "__main__":
    main()
