"""Fused, batch-invariant attention over a KV store on the CPU (``attn_kernel.c``).

One call per layer computes, for every packed query token and head, the causal softmax
attention over the first ``count`` keys and values of the token's slot of the store: scores,
max, a vectorised exp, the normaliser and the weighted sum, in a fixed order that depends on
nothing but the token's own query, its keys and values and ``count`` (see the kernel's
header). A token's result is therefore bitwise the same decoded alone, inside a verify of k+1
tokens, among 15 other rows, in a prefill chunk of any size and under any thread split: the
KV a prefill writes equals what decode steps write, and the prefix cache stays exact.

The kernel is compiled into the quantized kernel's extension (``mtplx.quant``: the same
build, cache and CPU-feature variants). It serves float32 stores on the CPU; elsewhere
``SlotTarget`` keeps MLX's own ops (``mtplx.models.compiled_layer``).
"""

from __future__ import annotations

import mlx.core as mx

from mtplx.quant import Unavailable, load_extension

__all__ = ["attend", "available", "exp", "lanes", "set_threads", "split_calls"]


def available(dtype: mx.Dtype = mx.float32) -> bool:
    """Whether the kernel serves a store of ``dtype`` here (CPU, float32, extension built)."""
    if mx.default_device() != mx.cpu or dtype != mx.float32:
        return False
    try:
        load_extension()
    except Unavailable:
        return False
    return True


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    counts: mx.array,
    scale: float,
) -> mx.array:
    """Causal attention of packed query tokens over a KV store, lazily.

    queries [n, heads, d] (roped), keys [S, kv, cap, d], values [S, kv, cap, dv] (dv >= d:
    only the first d features are read), slots [n] int32 (each token's store index), counts
    [n] int32 (the keys each token sees: its position + 1) -> [n, heads * d] float32.
    """
    return load_extension().attend(queries, keys, values, slots, counts, float(scale))


def set_threads(threads: int) -> None:
    """Threads that split a large call's (token, kv head) items (0: the quantized kernel's
    setting); each item is computed whole by one thread, so no bit changes."""
    load_extension().attn_set_threads(max(0, int(threads)))


def split_calls() -> int:
    """Calls computed by more than one thread so far (lets tests see the split happen)."""
    return int(load_extension().attn_split_calls())


def exp(x: float) -> float:
    """The kernel's vectorised exp on one value (for tests)."""
    return float(load_extension().attn_exp(float(x)))


def lanes() -> int:
    """The kernel's vector width (16 for AVX-512 builds, else 8)."""
    return int(load_extension().attn_lanes())
