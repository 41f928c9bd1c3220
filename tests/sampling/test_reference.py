"""Exactness of the plain references (``mtplx.sampling.reference``): the oracle returns p for
every (p, q), the one-position rule's output is distributed as p, and the filters, penalties
and temperature do what their docstrings say."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from mtplx.request import SamplerConfig
from mtplx.sampling.reference import (
    acceptance_probability,
    apply_penalties,
    apply_top_p_top_k,
    distribution_from_logits,
    residual_distribution,
    sample_from_distribution,
    speculative_output_marginal,
    verify_one_token,
)

# A fixed significance for every chi-square test: with fixed seeds each test is deterministic,
# and a real bias of the size these sample counts can see gives p-values far below it.
SIGNIFICANCE = 1e-3


# ---------------------------------------------------------------------------------------------
# The exact oracle
# ---------------------------------------------------------------------------------------------


HAND_PICKED = {
    "seed-document example": ([0.6, 0.3, 0.1], [0.4, 0.4, 0.2]),
    "disjoint supports": ([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.7, 0.3]),
    "draft zero where target has mass": ([0.2, 0.3, 0.5], [0.0, 1.0, 0.0]),
    "p equals q": ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5]),
    "one-hot target": ([0.0, 1.0, 0.0], [0.3, 0.3, 0.4]),
    "one-hot draft on a target token": ([0.1, 0.7, 0.2], [0.0, 1.0, 0.0]),
    "draft wider than target": ([1.0, 0.0, 0.0], [0.1, 0.1, 0.8]),
}


@pytest.mark.parametrize("target, draft", HAND_PICKED.values(), ids=HAND_PICKED.keys())
def test_oracle_returns_target_on_hand_picked_pairs(
    target: list[float], draft: list[float]
) -> None:
    p, q = np.array(target), np.array(draft)
    np.testing.assert_allclose(speculative_output_marginal(p, q), p, rtol=0, atol=1e-12)


def test_seed_document_example_has_residual_one_zero_zero() -> None:
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.4, 0.4, 0.2])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0.0, 0.0], atol=1e-15)
    accept = [acceptance_probability(p, q, token) for token in range(3)]
    np.testing.assert_allclose(accept, [1.0, 0.75, 0.5])


def test_oracle_is_not_normalised_after_the_fact() -> None:
    """A marginal that adds only the draft token's own residual share (the seed documents'
    mistake) sums to less than 1; ours must sum to 1 without any renormalisation."""
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.4, 0.4, 0.2])
    marginal = speculative_output_marginal(p, q)
    assert marginal.sum() == pytest.approx(1.0, abs=1e-15)
    seed_style = np.zeros(3)
    residual = residual_distribution(p, q)
    for token in range(3):
        accept = acceptance_probability(p, q, token)
        seed_style[token] += q[token] * accept + q[token] * (1 - accept) * residual[token]
    assert seed_style.sum() < 0.9  # what the seed's final normalisation would have hidden


def _distribution(values: np.ndarray) -> np.ndarray:
    return values / values.sum()


probability_vectors = arrays(
    np.float64, st.integers(2, 12), elements=st.floats(0, 1, allow_subnormal=False)
).filter(lambda v: v.sum() > 1e-3)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_oracle_returns_target_on_generated_pairs(data: st.DataObject) -> None:
    target = _distribution(data.draw(probability_vectors))
    draft_raw = data.draw(
        arrays(np.float64, target.shape, elements=st.floats(0, 1, allow_subnormal=False))
    )
    if draft_raw.sum() <= 1e-3:
        draft_raw[data.draw(st.integers(0, target.size - 1))] = 1.0  # a one-hot draft
    draft = _distribution(draft_raw)
    np.testing.assert_allclose(
        speculative_output_marginal(target, draft), target, rtol=0, atol=1e-12
    )


# ---------------------------------------------------------------------------------------------
# The one-position rule, statistically
# ---------------------------------------------------------------------------------------------


def test_verify_one_token_histogram_matches_target() -> None:
    rng = np.random.default_rng(1234)
    p = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
    q = np.array([0.05, 0.4, 0.1, 0.15, 0.3])
    num_trials = 200_000
    counts = np.zeros(p.size)
    num_accepted = 0
    for _ in range(num_trials):
        draft_token = sample_from_distribution(q, rng.random())
        decision = verify_one_token(p, q, draft_token, rng)
        counts[decision.token_id] += 1
        num_accepted += decision.accepted
    assert stats.chisquare(counts, p * num_trials).pvalue > SIGNIFICANCE
    expected_acceptance = np.minimum(p, q).sum()
    assert num_accepted / num_trials == pytest.approx(expected_acceptance, abs=0.005)


def test_sample_from_distribution_never_returns_zero_weight() -> None:
    weights = np.array([0.0, 0.5, 0.0, 0.5, 0.0], dtype=np.float32)
    assert {sample_from_distribution(weights, u) for u in (0.0, 0.49, 0.5, 0.999999)} == {1, 3}
    assert sample_from_distribution(weights, np.nextafter(np.float32(1), np.float32(0))) == 3


# ---------------------------------------------------------------------------------------------
# Filtering, penalties, temperature
# ---------------------------------------------------------------------------------------------


def _support(probs: np.ndarray) -> set[int]:
    return set(np.flatnonzero(probs > 0).tolist())


def test_top_k_keeps_ties_at_the_boundary() -> None:
    probs = np.array([0.1, 0.3, 0.2, 0.2, 0.2])
    assert _support(apply_top_p_top_k(probs, top_k=1)) == {1}
    assert _support(apply_top_p_top_k(probs, top_k=2)) == {1, 2, 3, 4}
    assert _support(apply_top_p_top_k(probs, top_k=5)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_smallest_prefix_reaching_the_mass_plus_ties() -> None:
    probs = np.array([0.125, 0.5, 0.25, 0.125])
    assert _support(apply_top_p_top_k(probs, top_p=0.5)) == {1}
    assert _support(apply_top_p_top_k(probs, top_p=0.5 + 1e-9)) == {1, 2}
    assert _support(apply_top_p_top_k(probs, top_p=0.75)) == {1, 2}
    assert _support(apply_top_p_top_k(probs, top_p=0.8)) == {0, 1, 2, 3}  # the 0.125 tie
    filtered = apply_top_p_top_k(probs, top_p=0.75)
    np.testing.assert_allclose(filtered, [0, 2 / 3, 1 / 3, 0])


def test_top_p_is_measured_after_top_k() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # After top-k=2 the survivors weigh 4/7 and 3/7; top-p 0.5 then keeps only the first.
    assert _support(apply_top_p_top_k(probs, top_p=0.5, top_k=2)) == {0}


def test_min_p_keeps_tokens_at_least_min_p_times_the_max() -> None:
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    assert _support(apply_top_p_top_k(probs, min_p=0.25)) == {0, 1, 2, 3}
    assert _support(apply_top_p_top_k(probs, min_p=0.5)) == {0, 1}
    assert _support(apply_top_p_top_k(probs, min_p=1.0)) == {0}


def test_filters_never_empty_the_support() -> None:
    probs = np.full(8, 1 / 8)
    for top_p, top_k, min_p in [(1e-9, 1, 1.0), (0.01, 0, 0.0), (1.0, 1, 0.0)]:
        filtered = apply_top_p_top_k(probs, top_p, top_k, min_p)
        assert filtered.sum() == pytest.approx(1.0)
        assert _support(filtered)


def test_penalties_change_exactly_the_seen_logits() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.5, -1.0])
    counts = np.array([0, 3, 1, 0, 0])
    config = SamplerConfig(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, counts, config)
    np.testing.assert_allclose(out, [2.0, -2.0 * 2 - 1.5 - 0.25, 1.0 / 2 - 0.5 - 0.25, 0.5, -1.0])


def test_logit_bias_adds_to_named_tokens_only() -> None:
    logits = np.zeros(4)
    out = apply_penalties(logits, None, SamplerConfig(logit_bias={2: 5.0, "0": -100}))
    np.testing.assert_array_equal(out, [-100.0, 0.0, 5.0, 0.0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, None, SamplerConfig(logit_bias={9: 1.0}))


def test_penalties_without_history_change_nothing() -> None:
    logits = np.array([1.0, 2.0])
    config = SamplerConfig(repetition_penalty=1.5, presence_penalty=1.0)
    np.testing.assert_array_equal(apply_penalties(logits, None, config), logits)


def test_temperature_scales_logits_before_softmax() -> None:
    logits = np.array([1.0, 2.0, 0.0])
    probs = distribution_from_logits(logits, SamplerConfig(temperature=0.5))
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(probs, expected, rtol=1e-12)
