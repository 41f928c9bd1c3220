"""The vectorised MLX form of exact speculative sampling: over a batch of rows and K draft
positions at once, as the engine runs it.

Glossary (``mtplx.sampling``): draft tokens with their q, target distribution p, accepted
(``u < min(1, p(x) / q(x))``), recovered (drawn from the residual ``max(p - q, 0)`` at the
first rejection), bonus (drawn from p after K accepted drafts).

Every function here is the twin of a plain reference in ``mtplx.sampling.reference``
(``mx_apply_penalties`` of ``apply_penalties``, ``mx_apply_top_p_top_k`` of
``apply_top_p_top_k``, ``mx_distribution_from_logits`` of ``distribution_from_logits``,
``mx_sample`` of ``sample_from_distribution``, ``mx_verify_draft_tokens`` of
``verify_draft_tokens_reference``); ``mx_verify_greedy`` is ``mx_verify_draft_tokens`` at
temperature 0, from the logits. Both sides consume explicit uniforms, so fed the same
uniforms and float32 inputs they make identical decisions: the ratio test is one correctly
rounded float32 division in both, and tokens are drawn by inverse CDF over a sequential
float32 cumulative sum in both. On the CPU ``mtplx.sampling.fast_path`` runs the sampled
path as C nodes with these functions' bits.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from mtplx.errors import InvalidParameter
from mtplx.request import SamplerConfig

__all__ = [
    "biased_logits",
    "mx_apply_penalties",
    "mx_apply_top_p_top_k",
    "mx_distribution_from_logits",
    "mx_sample",
    "mx_verify_draft_tokens",
    "mx_verify_greedy",
]


def mx_apply_penalties(
    logits: mx.array, token_counts: mx.array | None, config: SamplerConfig
) -> mx.array:
    """MLX twin of ``apply_penalties``. logits: [..., V] float32; token_counts: [..., V]."""
    if token_counts is not None and config.has_penalties:
        counts = token_counts.astype(mx.float32)
        seen = counts > 0
        if config.repetition_penalty != 1.0:
            penalised = mx.where(
                logits > 0, logits / config.repetition_penalty, logits * config.repetition_penalty
            )
            # A penalty far from 1 overflows float32 (or 0 * inf: NaN): finite, as the twin.
            penalised = mx.nan_to_num(penalised)  # inf -> float32's largest, NaN -> 0
            logits = mx.where(seen, penalised, logits)
        logits = logits - config.frequency_penalty * counts - config.presence_penalty * seen
    if config.logit_bias:
        vocab_size = logits.shape[-1]
        token_ids = list(config.logit_bias)
        if max(token_ids) >= vocab_size:
            raise InvalidParameter(
                "logit_bias", f"logit_bias token id {max(token_ids)} is outside the vocabulary"
            )
        bias = np.zeros(vocab_size, dtype=np.float32)
        bias[token_ids] = list(config.logit_bias.values())
        logits = logits + mx.array(bias)
    return logits


def mx_apply_top_p_top_k(
    probs: mx.array, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> mx.array:
    """MLX twin of ``apply_top_p_top_k`` (same order, same tie rule). probs: [..., V].

    With top-k on, no full-vocabulary sort is needed: a partition finds the k-th largest
    probability, and the nucleus lies within the k largest survivors, so top-p sorts only
    those k values (the survivors beyond k are ties of the k-th value, whose threshold is the
    same). Without top-k, top-p sorts the whole row."""
    vocab_size = probs.shape[-1]
    use_top_k = 0 < top_k < vocab_size
    if not (use_top_k or top_p < 1.0 or min_p > 0.0):
        return probs
    keep = probs > 0
    if use_top_k:
        split = vocab_size - top_k
        kth_largest = mx.partition(probs, split, axis=-1)[..., split : split + 1]
        keep = keep & (probs >= kth_largest)
    if top_p < 1.0:
        kept = mx.where(keep, probs, 0.0)
        kept = kept / mx.sum(kept, axis=-1, keepdims=True)
        if use_top_k:
            largest = mx.partition(kept, split, axis=-1)[..., split:]
            descending = mx.sort(largest, axis=-1)[..., ::-1]
        else:
            descending = mx.sort(kept, axis=-1)[..., ::-1]
        mass_before = mx.cumsum(descending, axis=-1, inclusive=False)
        # At least the first: a top_p below float32's smallest value rounds to 0 in the
        # comparison (NumPy's float64 keeps it), and 0 would index the last, keeping all.
        num_in_nucleus = mx.maximum(mx.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
        threshold = mx.take_along_axis(descending, num_in_nucleus - 1, axis=-1)
        keep = keep & (kept >= threshold)
    if min_p > 0.0:
        keep = keep & (probs >= min_p * mx.max(probs, axis=-1, keepdims=True))
    filtered = mx.where(keep, probs, 0.0)
    return filtered / mx.sum(filtered, axis=-1, keepdims=True)


def biased_logits(
    logits: mx.array,
    config: SamplerConfig,
    token_counts: mx.array | None,
    mask: mx.array | None,
) -> mx.array:
    """The logits the softmax takes: penalties, bias and the grammar mask applied, as
    ``mx_distribution_from_logits`` applies them (the C nodes of ``fast_path`` take these)."""
    logits = mx_apply_penalties(logits.astype(mx.float32), token_counts, config)
    if mask is not None:
        logits = mx.where(mask, logits, -mx.inf)
    return logits


def mx_distribution_from_logits(
    logits: mx.array,
    config: SamplerConfig,
    token_counts: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """MLX twin of ``distribution_from_logits``. logits: [..., V]; mask: [..., V] bool or
    None (no grammar: the graph is exactly the unmasked one); returns float32 [..., V]."""
    logits = biased_logits(logits, config, token_counts, mask)
    if config.is_greedy:
        vocab_ids = mx.arange(logits.shape[-1])
        return (vocab_ids == mx.argmax(logits, axis=-1, keepdims=True)).astype(mx.float32)
    # As the twin: (logits - max) / T is <= 0, never NaN however small T or large a logit.
    shifted = logits - mx.max(logits, axis=-1, keepdims=True)
    probs = mx.softmax(shifted / config.temperature, axis=-1, precise=True)
    return mx_apply_top_p_top_k(probs, config.top_p, config.top_k, config.min_p)


def mx_sample(weights: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse-CDF draw per row, twin of ``sample_from_distribution``.

    weights: [B, V] non-negative, not necessarily normalised; uniforms: [B] in [0, 1).
    Returns token ids [B] (uint32); a zero-weight token is never returned.
    """
    vocab_size = weights.shape[-1]
    cumulative = mx.cumsum(weights, axis=-1)
    threshold = uniforms.astype(weights.dtype)[:, None] * cumulative[:, -1:]
    index = mx.sum(cumulative <= threshold, axis=-1)
    last_live = vocab_size - 1 - mx.argmax((weights > 0)[:, ::-1], axis=-1)
    return mx.where(index >= vocab_size, last_live, index).astype(mx.uint32)


def mx_verify_draft_tokens(
    target_probs: mx.array,
    draft_probs: mx.array,
    draft_tokens: mx.array,
    accept_uniforms: mx.array,
    sample_uniforms: mx.array,
) -> tuple[mx.array, mx.array]:
    """Verify K draft positions of B sequences at once with the exact rule.

    target_probs: [B, K+1, V] float32; draft_probs: [B, K, V] float32 (zero outside a
    reduced draft vocabulary is fine); draft_tokens: [B, K]; accept_uniforms: [B, K];
    sample_uniforms: [B]. Returns num_accepted [B] (int32) and output_tokens [B, K+1]
    (int32): the accepted prefix of the draft, the recovered or bonus token, then -1.
    """
    batch, num_draft = draft_tokens.shape
    rows = mx.arange(batch)
    if num_draft == 0:
        token = mx_sample(target_probs[:, 0], sample_uniforms).astype(mx.int32)
        return mx.zeros((batch,), dtype=mx.int32), token[:, None]
    draft_tokens = draft_tokens.astype(mx.int32)
    indices = draft_tokens[..., None]
    target_at_draft = mx.take_along_axis(target_probs[:, :num_draft], indices, axis=-1)[..., 0]
    draft_at_draft = mx.take_along_axis(draft_probs, indices, axis=-1)[..., 0]
    # u < p / q in float32; a draft the drafter could not have drawn (q == 0) is rejected.
    accepted = (draft_at_draft > 0) & (accept_uniforms < target_at_draft / draft_at_draft)
    num_accepted = mx.sum(mx.cumprod(accepted.astype(mx.int32), axis=-1), axis=-1)

    # The distribution the one sampled token comes from: the residual at the first rejected
    # position, or p itself at position K+1 (q is zero there, so the residual is p).
    final_target = target_probs[rows, num_accepted]
    was_rejected = (num_accepted < num_draft)[:, None]
    final_draft = draft_probs[rows, mx.minimum(num_accepted, num_draft - 1)] * was_rejected
    residual = mx.maximum(final_target - final_draft, 0.0)
    has_residual = mx.cumsum(residual, axis=-1)[:, -1:] > 0
    token = mx_sample(mx.where(has_residual, residual, final_target), sample_uniforms)

    positions = mx.arange(num_draft + 1)[None, :]
    padded_drafts = mx.concatenate([draft_tokens, mx.zeros((batch, 1), mx.int32)], axis=1)
    boundary = num_accepted[:, None]
    output_tokens = mx.where(
        positions < boundary,
        padded_drafts,
        mx.where(positions == boundary, token.astype(mx.int32)[:, None], -1),
    )
    return num_accepted.astype(mx.int32), output_tokens


def mx_verify_greedy(target_logits: mx.array, draft_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """``mx_verify_draft_tokens`` at temperature 0, from the logits.

    target_logits: [B, K+1, V] float32, penalised, biased and masked as
    ``mx_distribution_from_logits`` does before its argmax; draft_tokens: [B, K] drawn
    greedily, so each q is one-hot at its draft token. p is one-hot at the argmax, so the
    exact rule accepts a draft iff it is the argmax (u < p / q = 1), and the residual at the
    first mismatch, or p after the last draft, is one-hot at the argmax there: the same
    num_accepted [B] and output_tokens [B, K+1] without building [K+1, V] distributions."""
    greedy = mx.argmax(target_logits, axis=-1)  # [B, K+1]
    return _greedy_verdict(greedy, draft_tokens, _columns(int(draft_tokens.shape[1]) + 1))


@functools.lru_cache(maxsize=16)
def _columns(width: int) -> mx.array:
    """[1, width] int32 0 .. width - 1, evaluated: a constant of the verdict's graph, where
    an ``arange`` in it is two nodes in every verify."""
    columns = mx.arange(width, dtype=mx.int32)[None]
    mx.eval(columns)
    return columns


@mx.compile
def _greedy_verdict(
    greedy: mx.array, draft_tokens: mx.array, columns: mx.array
) -> tuple[mx.array, mx.array]:
    """``mx_verify_greedy`` from the argmaxes greedy [B, K+1], the drafts [B, K] and
    ``_columns(K + 1)``: the accepted drafts are the argmaxes at their positions, and the
    token after them is the argmax there, so the committed tokens are the argmaxes up to the
    first mismatch and -1 past it. Compiled: its elementwise steps are one node (a verify's
    bookkeeping is graph nodes on the engine thread, each costing about as much as a small
    kernel); one draft needs no running product of its matches."""
    greedy = greedy.astype(mx.int32)
    num_draft = draft_tokens.shape[1]
    if num_draft == 0:
        return mx.zeros(greedy.shape[:1], mx.int32), greedy
    matches = (draft_tokens.astype(mx.int32) == greedy[:, :num_draft]).astype(mx.int32)
    if num_draft > 1:  # a draft counts only after every draft before it matched
        matches = mx.cumprod(matches, axis=-1)
    accepted = mx.sum(matches, axis=-1, keepdims=True).astype(mx.int32)  # [B, 1]
    output_tokens = mx.where(columns <= accepted, greedy, -1)
    return accepted.reshape(-1), output_tokens
