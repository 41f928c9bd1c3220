"""The plain reference of exact speculative sampling, in NumPy: the target and draft
distributions, the one-position rule and its exact oracle, and a row-by-row verdict.

Glossary (``mtplx.sampling``): draft tokens with their q, target distribution p, accepted
(``u < min(1, p(x) / q(x))``), recovered (drawn from the residual ``max(p - q, 0)`` at the
first rejection), bonus (drawn from p after K accepted drafts).

These are the plain twins every fast path is tested against: ``mtplx.sampling.mlx_ops``
holds the vectorised MLX form of each (``apply_penalties`` -> ``mx_apply_penalties``,
``apply_top_p_top_k`` -> ``mx_apply_top_p_top_k``, ``distribution_from_logits`` ->
``mx_distribution_from_logits``, ``sample_from_distribution`` -> ``mx_sample``,
``verify_draft_tokens_reference`` -> ``mx_verify_draft_tokens``). Both consume explicit
uniforms, so fed the same uniforms and float32 inputs they make identical decisions: the
ratio test is one correctly rounded float32 division in both, and tokens are drawn by inverse
CDF over a sequential float32 cumulative sum in both. The oracle
``speculative_output_marginal`` enumerates the rule and returns p for every (p, q).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtplx.errors import InvalidParameter
from mtplx.request import SamplerConfig

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32

__all__ = [
    "SpeculativeDecision",
    "acceptance_probability",
    "apply_penalties",
    "apply_top_p_top_k",
    "distribution_from_logits",
    "residual_distribution",
    "sample_from_distribution",
    "speculative_output_marginal",
    "verify_draft_tokens_reference",
    "verify_one_token",
]

# ---------------------------------------------------------------------------------------------
# Target and draft distributions
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
# The exact rule for one position, and a row-by-row verdict
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
