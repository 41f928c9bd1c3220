"""Exact speculative sampling: the sampler settings, the target/draft distributions and the
accept / recover / bonus rule.

Glossary (docs/architecture.md):

- draft tokens: proposed by a drafter, each with its proposal distribution q.
- target distribution p: the target model's next-token distribution after the request's
  penalties, logit bias, temperature and top-k / top-p / min-p filtering.
- accepted: a draft token x that passed ``u < min(1, p(x) / q(x))`` for a uniform u.
- recovered: the token sampled from the residual ``max(p - q, 0)`` (normalised) at the first
  rejected position.
- bonus: the token sampled from p at position K+1 when all K draft tokens were accepted.
- acceptance length: tokens committed per verify forward (accepted + 1).

The output marginal of one position is ``min(p, q) + (1 - sum(min(p, q))) * residual = p``,
so speculative decoding emits exactly what plain decoding of the target would.

Every fast path has a plain reference twin. The NumPy functions here are the references (and
the oracle ``speculative_output_marginal``); the ``mx_*`` functions are the vectorised MLX path
the engine runs. Both consume explicit uniforms, so fed the same uniforms and float32 inputs
they make identical decisions: the ratio test is one correctly rounded float32 division in
both, and tokens are drawn by inverse CDF over a sequential float32 cumulative sum in both.

On the CPU the engine's sampled path runs as C nodes (``distribution``, ``sample``,
``sample_logits``, ``verify_sampled_row``; the kernel is ``layer_kernel.c``'s sampling
section, wrapped in ``quant_ext.cpp``): the same MLX operations in the same order, so the
same bits as the ``mx_*`` functions (``tests/test_sampling_kernel.py`` compares them
bitwise), where those are ~20 graph nodes over [k+1, V] with MLX's scalar exp. Plain
decoding, the drafters' q and the verdict all take p from the same softmax, so speculative
and plain decoding sample from the same bits. ``MTPLX_SAMPLED_KERNEL=0`` keeps the MLX ops.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import numpy as np

from mtplx.errors import InvalidParameter
from mtplx.quant import Unavailable, load_extension
from mtplx.request import SamplerConfig

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32

__all__ = [
    "SamplerConfig",
    "SpeculativeDecision",
    "acceptance_probability",
    "apply_penalties",
    "apply_top_p_top_k",
    "distribution",
    "distribution_from_logits",
    "mx_apply_penalties",
    "mx_apply_top_p_top_k",
    "mx_distribution_from_logits",
    "mx_sample",
    "mx_verify_draft_tokens",
    "residual_distribution",
    "sample",
    "sample_from_distribution",
    "sample_logits",
    "sampling_kernel",
    "speculative_output_marginal",
    "verify_draft_tokens_reference",
    "verify_one_token",
    "verify_sampled_row",
]

# ---------------------------------------------------------------------------------------------
# Target and draft distributions (NumPy reference)
# ---------------------------------------------------------------------------------------------


def apply_penalties(
    logits: np.ndarray, token_counts: np.ndarray | None, config: SamplerConfig
) -> np.ndarray:
    """Apply repetition, frequency and presence penalties, then the logit bias.

    logits: [..., V]; token_counts: [..., V] how often each token was generated so far
    (committed tokens only), or None for no history. Returns new logits [..., V].

    Repetition penalty (CTRL / Hugging Face form): a seen token's positive logit is divided
    by it, a negative one multiplied. Frequency subtracts ``penalty * count``, presence
    subtracts ``penalty`` once per seen token (OpenAI form). Bias is added last.
    """
    logits = np.array(logits, dtype=np.result_type(logits, np.float32), copy=True)
    if token_counts is not None and config.has_penalties:
        counts = np.asarray(token_counts)
        seen = counts > 0
        if config.repetition_penalty != 1.0:
            penalised = np.where(
                logits > 0, logits / config.repetition_penalty, logits * config.repetition_penalty
            )
            # Kept within float32's finite range, as the MLX twin computes in float32.
            penalised = np.clip(np.nan_to_num(penalised), -FLOAT32_MAX, FLOAT32_MAX)
            logits = np.where(seen, penalised, logits)
        logits = logits - config.frequency_penalty * counts - config.presence_penalty * seen
    for token_id, bias in config.logit_bias.items():
        if token_id >= logits.shape[-1]:
            raise InvalidParameter(
                "logit_bias", f"logit_bias token id {token_id} is outside the vocabulary"
            )
        logits[..., token_id] += bias
    return logits


def apply_top_p_top_k(
    probs: np.ndarray, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> np.ndarray:
    """Filter a distribution with top-k, then top-p, then min-p, and renormalise.

    probs: [V] (or [..., V]). Ties at a boundary are all kept, so the kept set never depends
    on token order. top-k keeps tokens whose probability is >= the k-th largest; top-p keeps
    the smallest prefix of the sorted distribution whose mass reaches top_p (plus ties of its
    last member), measured after top-k; min-p keeps tokens >= min_p * max. The most likely
    token always survives, so the support is never empty.
    """
    probs = np.asarray(probs)
    if probs.ndim > 1:
        rows = [
            apply_top_p_top_k(row, top_p, top_k, min_p)
            for row in probs.reshape(-1, probs.shape[-1])
        ]
        return np.stack(rows).reshape(probs.shape)
    keep = probs > 0
    if 0 < top_k < probs.shape[-1]:
        kth_largest = np.sort(probs)[::-1][top_k - 1]
        keep &= probs >= kth_largest
    if top_p < 1.0:
        kept = np.where(keep, probs, 0)
        kept = kept / kept.sum()
        descending = np.sort(kept)[::-1]
        mass_before = np.concatenate([[0.0], np.cumsum(descending)[:-1]])
        num_in_nucleus = int(np.sum(mass_before < top_p))
        keep &= kept >= descending[num_in_nucleus - 1]
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    filtered = np.where(keep, probs, 0)
    return filtered / filtered.sum()


def distribution_from_logits(
    logits: np.ndarray,
    config: SamplerConfig,
    token_counts: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """The sampling distribution for one position: penalties and bias, the grammar mask,
    temperature, filters.

    logits: [V] (or [..., V]); mask: [V] (or [..., V]) bool, the tokens a grammar allows
    (None: all), at least one per row. Returns probabilities [..., V] in float64 that sum to
    1: with a mask, p renormalised over the allowed tokens (the filters then act on that).
    Temperature 0 returns the one-hot argmax (ties to the lowest token id).
    """
    logits = apply_penalties(np.asarray(logits, dtype=np.float64), token_counts, config)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    if config.is_greedy:
        one_hot = np.zeros_like(logits)
        np.put_along_axis(one_hot, np.argmax(logits, axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    # The largest logit is subtracted before dividing by T: (logits - max) / T <= 0, 0 at
    # the max, so a small T or large logits overflow to -inf (probability 0), never to NaN.
    scaled = (logits - logits.max(axis=-1, keepdims=True)) / config.temperature
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    return apply_top_p_top_k(probs, config.top_p, config.top_k, config.min_p)


# ---------------------------------------------------------------------------------------------
# The exact rule for one position (NumPy reference)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeDecision:
    """Outcome of verifying one draft token: the emitted token and whether it was the draft."""

    accepted: bool
    token_id: int
    accept_probability: float


def acceptance_probability(target_p: np.ndarray, draft_q: np.ndarray, token_id: int) -> float:
    """``min(1, p(x) / q(x))`` for draft token x. A token the draft could not have drawn
    (q(x) == 0) is never accepted."""
    q = draft_q[token_id]
    if q <= 0:
        return 0.0
    return float(min(1.0, target_p[token_id] / q))


def residual_distribution(target_p: np.ndarray, draft_q: np.ndarray) -> np.ndarray:
    """``max(p - q, 0) / sum(max(p - q, 0))``: what a rejection samples from.

    For p = [0.6, 0.3, 0.1] and q = [0.4, 0.4, 0.2] this is [1, 0, 0]. When p == q there is
    no residual mass and rejection has probability zero; p is returned so the result is
    always a distribution.
    """
    residual = np.maximum(target_p - draft_q, 0)
    total = residual.sum()
    if total <= 0:
        return target_p / target_p.sum()
    return residual / total


def sample_from_distribution(probs: np.ndarray, uniform: float) -> int:
    """Inverse-CDF draw from possibly unnormalised non-negative weights with one uniform in
    [0, 1). Cumulates sequentially in the weights' dtype (as the MLX twin does) and never
    returns a zero-weight token."""
    cumulative = np.cumsum(probs, dtype=probs.dtype)
    threshold = probs.dtype.type(uniform) * cumulative[-1]
    index = int(np.sum(cumulative <= threshold))
    if index >= probs.shape[-1]:  # uniform rounded up to the total: take the last live token
        index = int(np.flatnonzero(probs > 0)[-1])
    return index


def verify_one_token(
    target_p: np.ndarray, draft_q: np.ndarray, draft_token: int, rng: np.random.Generator
) -> SpeculativeDecision:
    """Accept ``draft_token`` with probability min(1, p/q); otherwise sample the recovered
    token from the residual. The emitted token is distributed exactly as p."""
    accept_probability = acceptance_probability(target_p, draft_q, draft_token)
    if rng.random() < accept_probability:
        return SpeculativeDecision(True, int(draft_token), accept_probability)
    residual = residual_distribution(target_p, draft_q)
    return SpeculativeDecision(
        False, sample_from_distribution(residual, rng.random()), accept_probability
    )


def speculative_output_marginal(target_p: np.ndarray, draft_q: np.ndarray) -> np.ndarray:
    """The exact distribution of the token one speculative position emits, by enumeration.

    Sums, over every draft token x the drafter can propose, ``q(x) * a(x)`` onto x (accepted)
    and ``q(x) * (1 - a(x)) * residual`` onto every token (rejected, recovered). No final
    normalisation: the result equals p for every (p, q), which is what the tests check.
    """
    target_p = np.asarray(target_p, dtype=np.float64)
    draft_q = np.asarray(draft_q, dtype=np.float64)
    residual = residual_distribution(target_p, draft_q)
    marginal = np.zeros_like(target_p)
    for token_id in np.flatnonzero(draft_q > 0):
        accept = acceptance_probability(target_p, draft_q, int(token_id))
        marginal[token_id] += draft_q[token_id] * accept
        marginal += draft_q[token_id] * (1.0 - accept) * residual
    return marginal


def verify_draft_tokens_reference(
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    draft_tokens: np.ndarray,
    accept_uniforms: np.ndarray,
    sample_uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Plain twin of ``mx_verify_draft_tokens``: a loop over rows and positions.

    target_probs: [B, K+1, V]; draft_probs: [B, K, V]; draft_tokens: [B, K];
    accept_uniforms: [B, K]; sample_uniforms: [B] (one draw per row: the recovered or bonus
    token). Returns num_accepted [B] and output_tokens [B, K+1]: the accepted draft tokens,
    then the recovered or bonus token, then -1 padding.
    """
    batch, num_draft = draft_tokens.shape
    num_accepted = np.zeros(batch, dtype=np.int32)
    output_tokens = np.full((batch, num_draft + 1), -1, dtype=np.int32)
    for row in range(batch):
        position = 0
        while position < num_draft:
            token = int(draft_tokens[row, position])
            p, q = target_probs[row, position, token], draft_probs[row, position, token]
            # The same float32 division the MLX path does: u < p / q, never taken when q == 0.
            if not (q > 0 and accept_uniforms[row, position] < p / q):
                break
            output_tokens[row, position] = token
            position += 1
        num_accepted[row] = position
        weights = target_probs[row, position]
        if position < num_draft:
            residual = np.maximum(weights - draft_probs[row, position], 0)
            if np.cumsum(residual, dtype=residual.dtype)[-1] > 0:
                weights = residual
        output_tokens[row, position] = sample_from_distribution(weights, sample_uniforms[row])
    return num_accepted, output_tokens


# ---------------------------------------------------------------------------------------------
# Vectorised MLX path (what the engine runs); every function has a NumPy twin above
# ---------------------------------------------------------------------------------------------


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


def mx_distribution_from_logits(
    logits: mx.array,
    config: SamplerConfig,
    token_counts: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """MLX twin of ``distribution_from_logits``. logits: [..., V]; mask: [..., V] bool or
    None (no grammar: the graph is exactly the unmasked one); returns float32 [..., V]."""
    logits = _biased(logits, config, token_counts, mask)
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


# ---------------------------------------------------------------------------------------------
# The engine's sampled path: C nodes where they serve, else the MLX twins above (same bits)
# ---------------------------------------------------------------------------------------------

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


def _biased(
    logits: mx.array,
    config: SamplerConfig,
    token_counts: mx.array | None,
    mask: mx.array | None,
) -> mx.array:
    """The logits the softmax takes: penalties, bias and the grammar mask applied, as
    ``mx_distribution_from_logits`` applies them."""
    logits = mx_apply_penalties(logits.astype(mx.float32), token_counts, config)
    if mask is not None:
        logits = mx.where(mask, logits, -mx.inf)
    return logits


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
    biased = _biased(logits, config, token_counts, mask)
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
    p's pass, but a node reading a plain row's forward logits directly made the next
    forward's KV writes copy their stores at times: ``fused_layer.store_copies``.)"""
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
        x, temperature = _biased(target_logits, config, token_counts, masks), config.temperature
    accepted, tokens = kernel.sampled_verdict(
        x, draft_tokens, uniforms, draft_qs, temperature, accept_at, sample_at
    )
    return accepted, tokens
