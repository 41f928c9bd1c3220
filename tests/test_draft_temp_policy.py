"""Which draft distributions keep speculative decoding exact.

Any q is fine as long as it is the distribution the draft token was actually drawn from: a
draft sampled at another temperature, a greedy draft (one-hot argmax) and an n-gram proposal
(one-hot) all leave the output marginal equal to the target p. Declaring a q other than the
one sampled from is what breaks exactness, and the last tests show the oracle sees it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from mtplx.request import SamplerConfig
from mtplx.sampling.reference import (
    acceptance_probability,
    distribution_from_logits,
    residual_distribution,
    sample_from_distribution,
    speculative_output_marginal,
    verify_one_token,
)

SIGNIFICANCE = 1e-3
TARGET_LOGITS = np.array([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
DRAFT_LOGITS = np.array([1.0, 2.2, 0.0, 0.4, 0.9, -1.0])  # a different, imperfect drafter


def _marginal_when_drawn_from(
    target_p: np.ndarray, drawn_from: np.ndarray, declared_q: np.ndarray
) -> np.ndarray:
    """Exact output marginal when drafts come from ``drawn_from`` but verification is told
    ``declared_q``. Equal to the oracle when the two agree."""
    residual = residual_distribution(target_p, declared_q)
    marginal = np.zeros_like(target_p)
    for token in np.flatnonzero(drawn_from > 0):
        accept = acceptance_probability(target_p, declared_q, token)
        marginal[token] += drawn_from[token] * accept
        marginal += drawn_from[token] * (1 - accept) * residual
    return marginal


TARGET_CONFIGS = [
    SamplerConfig(temperature=0.0),
    SamplerConfig(temperature=0.6, top_p=0.95, top_k=20),
    SamplerConfig(temperature=1.0),
    SamplerConfig(temperature=1.4, min_p=0.05),
]


@pytest.mark.parametrize("target_config", TARGET_CONFIGS, ids=lambda c: f"T={c.temperature}")
@pytest.mark.parametrize("draft_temperature", [0.3, 1.0, 2.0])
def test_draft_at_another_temperature_keeps_marginal_exact(
    target_config: SamplerConfig, draft_temperature: float
) -> None:
    p = distribution_from_logits(TARGET_LOGITS, target_config)
    q = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=draft_temperature))
    np.testing.assert_allclose(speculative_output_marginal(p, q), p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("target_config", TARGET_CONFIGS, ids=lambda c: f"T={c.temperature}")
def test_greedy_draft_keeps_marginal_exact(target_config: SamplerConfig) -> None:
    p = distribution_from_logits(TARGET_LOGITS, target_config)
    q = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=0.0))
    assert q.max() == 1.0
    np.testing.assert_allclose(speculative_output_marginal(p, q), p, rtol=0, atol=1e-12)
    # A greedy draft is accepted with probability p(draft).
    draft_token = int(np.argmax(q))
    assert acceptance_probability(p, q, draft_token) == pytest.approx(p[draft_token])


@pytest.mark.parametrize("proposed_token", range(len(TARGET_LOGITS)))
def test_one_hot_ngram_proposal_keeps_marginal_exact(proposed_token: int) -> None:
    p = distribution_from_logits(TARGET_LOGITS, SamplerConfig(temperature=0.8))
    q = np.eye(len(p))[proposed_token]
    np.testing.assert_allclose(speculative_output_marginal(p, q), p, rtol=0, atol=1e-12)


def test_draft_at_another_temperature_statistically() -> None:
    rng = np.random.default_rng(31)
    p = distribution_from_logits(TARGET_LOGITS, SamplerConfig(temperature=0.6, top_k=4))
    q = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=1.5))
    num_trials = 100_000
    counts = np.zeros(len(p))
    for _ in range(num_trials):
        decision = verify_one_token(p, q, sample_from_distribution(q, rng.random()), rng)
        counts[decision.token_id] += 1
    support = p > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], p[support] * num_trials).pvalue > SIGNIFICANCE


def test_greedy_draft_under_sampled_target_statistically() -> None:
    rng = np.random.default_rng(32)
    p = distribution_from_logits(TARGET_LOGITS, SamplerConfig(temperature=1.0))
    q = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=0.0))
    draft_token = int(np.argmax(q))
    num_trials = 100_000
    counts = np.zeros(len(p))
    for _ in range(num_trials):
        counts[verify_one_token(p, q, draft_token, rng).token_id] += 1
    assert stats.chisquare(counts, p * num_trials).pvalue > SIGNIFICANCE


def test_declaring_the_target_temperature_q_for_a_draft_drawn_at_another_is_biased() -> None:
    p = distribution_from_logits(TARGET_LOGITS, SamplerConfig(temperature=1.0))
    drawn_from = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=0.3))
    declared = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=1.0))
    honest = _marginal_when_drawn_from(p, drawn_from, drawn_from)
    dishonest = _marginal_when_drawn_from(p, drawn_from, declared)
    np.testing.assert_allclose(honest, p, atol=1e-12)
    assert np.abs(dishonest - p).max() > 0.05


def test_greedy_draft_declared_as_soft_q_is_biased() -> None:
    p = distribution_from_logits(TARGET_LOGITS, SamplerConfig(temperature=1.0))
    drawn_from = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=0.0))
    declared = distribution_from_logits(DRAFT_LOGITS, SamplerConfig(temperature=1.0))
    assert np.abs(_marginal_when_drawn_from(p, drawn_from, declared) - p).max() > 0.05
