"""The engine's sampled path: the target distribution, a draw, and a sampled row's verdict,
as C nodes on the CPU with MLX's exact bits.

Glossary (``mtplx.sampling``): draft tokens with their q, target distribution p, accepted
(``u < min(1, p(x) / q(x))``), recovered (drawn from the residual ``max(p - q, 0)`` at the
first rejection), bonus (drawn from p after K accepted drafts).

Each function here is a fast path whose plain twin is in ``mtplx.sampling.mlx_ops`` (and
that one's in ``mtplx.sampling.reference``): ``distribution`` of
``mx_distribution_from_logits``, ``sample`` of ``mx_sample``, ``sample_logits`` of the two
together, ``verify_sampled_row`` of ``mx_verify_draft_tokens`` over
``mx_distribution_from_logits``. On the CPU they run as C nodes (the kernel is
``layer_kernel.c``'s sampling section, wrapped in ``quant_ext.cpp``): the same MLX
operations in the same order, so the same bits as the MLX twins
(``tests/sampling/test_fast_path.py`` compares them bitwise), where those are ~20 graph
nodes over [k+1, V] with MLX's scalar exp. Plain decoding, the drafters' q and the verdict
all take p from the same softmax, so speculative and plain decoding sample from the same
bits. Elsewhere (no extension, not the CPU) and with ``MTPLX_SAMPLED_KERNEL=0`` the MLX
twins serve.
"""

from __future__ import annotations

import os
from types import ModuleType

import mlx.core as mx

from mtplx.quant import Unavailable, load_extension
from mtplx.request import SamplerConfig
from mtplx.sampling.mlx_ops import (
    biased_logits,
    mx_distribution_from_logits,
    mx_sample,
    mx_verify_draft_tokens,
)

__all__ = ["distribution", "sample", "sample_logits", "sampling_kernel", "verify_sampled_row"]

# Read once: "0" keeps the MLX ops (for A/B measurements and as the kernels' twin).
_KERNEL_ON = os.environ.get("MTPLX_SAMPLED_KERNEL", "1").strip().lower() not in ("0", "false")


def sampling_kernel() -> ModuleType | None:
    """The extension whose nodes serve the sampled path (``sampled_distribution``,
    ``sampled_draw``, ``sampled_verdict``), or None where MLX's ops do: not the CPU, no
    extension, or ``MTPLX_SAMPLED_KERNEL=0``."""
    if not _KERNEL_ON or mx.default_device() != mx.cpu:
        return None
    try:
        return load_extension()
    except Unavailable:
        return None


def _filters_on(config: SamplerConfig, vocab_size: int) -> bool:
    """Whether top-k, top-p or min-p change a distribution over ``vocab_size`` tokens."""
    return 0 < config.top_k < vocab_size or config.top_p < 1.0 or config.min_p > 0.0


def distribution(
    logits: mx.array,
    config: SamplerConfig,
    token_counts: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """``mx_distribution_from_logits``'s bits with its max, shift, division, softmax and
    filters in one node (``sampling_kernel``) where the kernel serves."""
    kernel = sampling_kernel()
    if kernel is None or config.is_greedy:
        return mx_distribution_from_logits(logits, config, token_counts, mask)
    biased = biased_logits(logits, config, token_counts, mask)
    # A top_k of the vocabulary or more keeps every token (as the MLX ops read it), and the
    # node takes a C int: an API's top_k of 2**31 or more would not convert.
    top_k = config.top_k if config.top_k < logits.shape[-1] else 0
    probs: mx.array = kernel.sampled_distribution(
        biased, config.temperature, top_k, config.top_p, config.min_p
    )
    return probs


def sample(weights: mx.array, uniforms: mx.array) -> mx.array:
    """``mx_sample``'s tokens as [B] int32, in one node where the kernel serves.
    weights: [B, V] non-negative; uniforms: [B] in [0, 1)."""
    kernel = sampling_kernel()
    if kernel is None:
        return mx_sample(weights, uniforms).astype(mx.int32)
    token: mx.array = kernel.sampled_draw(weights, uniforms)
    return token


def sample_logits(
    logits: mx.array,
    config: SamplerConfig,
    uniforms: mx.array,
    token_counts: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """A draw per row from logits [B, V]: the tokens [B] int32 of
    ``mx_sample(mx_distribution_from_logits(...), uniforms)`` (greedy: the argmax), two
    nodes where the kernel serves. (One node drawing from the logits themselves would save
    p's pass, but a plain step one node shorter lets MLX's host, which runs up to ~110
    dispatches ahead of its CPU stream and decides donation when it dispatches, reach the
    next forward's KV writes before the stream has let go of the stores: they are then
    copied, ``fused_layer.store_copies``; benchmarks/results/2026-12-04-store-copies/.)"""
    return sample(distribution(logits, config, token_counts, mask), uniforms)


def verify_sampled_row(
    target_logits: mx.array,
    config: SamplerConfig,
    draft_tokens: mx.array,
    draft_qs: list[mx.array],
    uniforms: mx.array,
    accept_at: int,
    sample_at: int,
    token_counts: mx.array | None = None,
    masks: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One sampled row's verdict, lazily: ``mx_verify_draft_tokens`` over the target's
    distribution at its k + 1 positions (``mx_distribution_from_logits`` of target_logits
    [k+1, V] with token_counts and masks [k+1, V]), the drafts [k] int32 with their q
    (k x [V]), the accept uniforms ``uniforms[accept_at : accept_at + k]`` and the draw's
    ``uniforms[sample_at]`` -> (num_accepted [1], output_tokens [1, k+1]) int32. Where the
    kernel serves, one node that computes a position's p only when the verdict reaches it
    (with filters two: ``distribution``'s p of every position first)."""
    k = len(draft_qs)
    kernel = sampling_kernel()
    if kernel is None:
        target_probs = mx_distribution_from_logits(target_logits, config, token_counts, masks)
        draft_probs = (
            mx.stack(draft_qs)[None] if k else mx.zeros((1, 0, target_probs.shape[-1]), mx.float32)
        )
        return mx_verify_draft_tokens(
            target_probs[None],
            draft_probs,
            draft_tokens[None],
            uniforms[accept_at : accept_at + k][None],
            uniforms[sample_at : sample_at + 1],
        )
    if _filters_on(config, target_logits.shape[-1]):
        x, temperature = distribution(target_logits, config, token_counts, masks), 0.0
    else:
        x = biased_logits(target_logits, config, token_counts, masks)
        temperature = config.temperature
    accepted, tokens = kernel.sampled_verdict(
        x, draft_tokens, uniforms, draft_qs, temperature, accept_at, sample_at
    )
    return accepted, tokens
