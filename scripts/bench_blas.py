"""Forward time of a SmolLM2-135M-shaped f32 llama for 1/4/8 new tokens on top of a prefix.

Run once per BLAS to compare:

    python -m scripts.bench_blas                       # OpenBLAS through the mtplx shim
    MTPLX_BLAS=reference python -m scripts.bench_blas  # the wheel's reference BLAS
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


def build_model() -> llama.Model:
    """Random-weight float32 llama with SmolLM2-135M's shapes (~135M parameters)."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def time_forward(model: llama.Model, n_tokens: int, prefix: int, repeats: int) -> float:
    """Median seconds of one forward over ``n_tokens`` after ``prefix`` cached tokens."""
    cache = cache_lib.make_prompt_cache(model)
    mx.eval(model(mx.arange(prefix)[None] % 1000, cache=cache))
    tokens = (mx.arange(n_tokens)[None] + 7) % 1000
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append(time.perf_counter() - start)
        for c in cache:  # roll the verify back, as the engine does for rejected drafts
            c.trim(n_tokens)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        set_blas_threads(args.threads)
    info = blas_info()
    model = build_model()
    base = None
    print(f"BLAS: {info.name} threads={info.threads} fast={info.fast}")
    for n in (1, 4, 8):
        t = time_forward(model, n, args.prefix, args.repeats)
        base = base or t
        print(f"  {n} token(s): {t * 1e3:8.1f} ms  ({t / base:.2f}x one token)")


if __name__ == "__main__":
    main()
