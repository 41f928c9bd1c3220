"""Exactness of mtplx.sampling: the oracle, the one-position rule, the vectorised MLX path,
filtering and penalties, and SamplerConfig validation."""

from __future__ import annotations

import itertools
import math
from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from mtplx.errors import InvalidParameter
from mtplx.sampling import (
    SamplerConfig,
    acceptance_probability,
    apply_penalties,
    apply_top_p_top_k,
    distribution_from_logits,
    mx_apply_top_p_top_k,
    mx_distribution_from_logits,
    mx_sample,
    mx_verify_draft_tokens,
    mx_verify_greedy,
    residual_distribution,
    sample_from_distribution,
    speculative_output_marginal,
    verify_draft_tokens_reference,
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
# Vectorised MLX path: identical to the NumPy twin, exact over several positions
# ---------------------------------------------------------------------------------------------


def _random_verify_inputs(rng: np.random.Generator, batch: int, num_draft: int, vocab: int):
    target = rng.dirichlet(np.full(vocab, 0.3), size=(batch, num_draft + 1)).astype(np.float32)
    draft = rng.dirichlet(np.full(vocab, 0.3), size=(batch, num_draft)).astype(np.float32)
    # Mix in the drafts the engine meets: one-hot (greedy / n-gram), equal to p, zero-padded.
    draft[0] = np.eye(vocab, dtype=np.float32)[rng.integers(vocab, size=num_draft)]
    draft[1] = target[1, :num_draft]
    draft[2, :, : vocab // 2] = 0
    draft[2] /= draft[2].sum(-1, keepdims=True)
    target[3] = np.eye(vocab, dtype=np.float32)[rng.integers(vocab, size=num_draft + 1)]
    tokens = np.array(
        [
            [sample_from_distribution(draft[b, k], rng.random()) for k in range(num_draft)]
            for b in range(batch)
        ],
        dtype=np.int32,
    ).reshape(batch, num_draft)
    accept_uniforms = rng.random((batch, num_draft), dtype=np.float32)
    sample_uniforms = rng.random(batch, dtype=np.float32)
    return target, draft, tokens, accept_uniforms, sample_uniforms


@pytest.mark.parametrize("num_draft", [0, 1, 4])
def test_mlx_verify_matches_numpy_reference_decision_for_decision(num_draft: int) -> None:
    rng = np.random.default_rng(num_draft)
    inputs = _random_verify_inputs(rng, batch=400, num_draft=num_draft, vocab=37)
    ref_accepted, ref_tokens = verify_draft_tokens_reference(*inputs)
    mx_accepted, mx_tokens = mx_verify_draft_tokens(*(mx.array(x) for x in inputs))
    np.testing.assert_array_equal(np.array(mx_accepted), ref_accepted)
    np.testing.assert_array_equal(np.array(mx_tokens), ref_tokens)
    if num_draft:
        assert 0 < ref_accepted.mean() < num_draft  # both outcomes occur


@pytest.mark.parametrize("num_draft", [0, 1, 2, 4])
def test_greedy_verify_matches_the_exact_rule_decision_for_decision(num_draft: int) -> None:
    """The greedy fast path against the general rule on one-hot p (argmax of the logits,
    ties included: coarse logits) and greedy drafts' one-hot q, any uniforms."""
    rng = np.random.default_rng(100 + num_draft)
    batch, vocab = 400, 13
    logits = rng.integers(-3, 3, size=(batch, num_draft + 1, vocab)).astype(np.float32)
    greedy = logits.argmax(-1)
    # Drafts: the argmax most of the time, so long accepted prefixes occur.
    tokens = np.where(
        rng.random((batch, num_draft)) < 0.7,
        greedy[:, :num_draft],
        rng.integers(0, vocab, size=(batch, num_draft)),
    ).astype(np.int32)
    target = np.eye(vocab, dtype=np.float32)[greedy]
    draft = np.eye(vocab, dtype=np.float32)[tokens]
    accept = rng.random((batch, num_draft), dtype=np.float32)
    sample = rng.random(batch, dtype=np.float32)
    ref_accepted, ref_tokens = mx_verify_draft_tokens(
        *(mx.array(x) for x in (target, draft, tokens, accept, sample))
    )
    accepted, output = mx_verify_greedy(mx.array(logits), mx.array(tokens))
    np.testing.assert_array_equal(np.array(accepted), np.array(ref_accepted))
    np.testing.assert_array_equal(np.array(output), np.array(ref_tokens))
    if num_draft:
        counts = np.bincount(np.array(accepted), minlength=num_draft + 1)
        assert (counts > 0).all()  # every prefix length occurs


def test_mx_sample_matches_numpy_twin() -> None:
    rng = np.random.default_rng(7)
    weights = rng.random((300, 1000), dtype=np.float32) * (rng.random((300, 1000)) < 0.1)
    uniforms = rng.random(300, dtype=np.float32)
    uniforms[0] = np.nextafter(np.float32(1), np.float32(0))
    expected = [sample_from_distribution(w, u) for w, u in zip(weights, uniforms, strict=True)]
    np.testing.assert_array_equal(
        np.array(mx_sample(mx.array(weights), mx.array(uniforms))), expected
    )


VOCAB = 3
NUM_GENERATED = 3


@cache
def _table(kind: str, prefix: tuple[int, ...]) -> np.ndarray:
    """A fixed next-token distribution for every prefix: the 'model' (p) or 'drafter' (q)."""
    rng = np.random.default_rng([ord(kind), len(prefix), *prefix])
    return rng.dirichlet(np.ones(VOCAB)).astype(np.float32)


def _exact_sequence_distribution() -> dict[tuple[int, ...], float]:
    """Plain decoding, enumerated: P(t1..tn) = prod p(t_i | t_<i)."""
    exact = {}
    for sequence in itertools.product(range(VOCAB), repeat=NUM_GENERATED):
        exact[sequence] = math.prod(
            float(_table("p", sequence[:i])[sequence[i]]) for i in range(NUM_GENERATED)
        )
    return exact


@pytest.mark.parametrize("num_draft", [1, 2, 3])
def test_mlx_verify_loop_output_matches_enumerated_sequence_distribution(num_draft: int) -> None:
    """Generate 3 tokens with repeated draft/verify steps on B sequences at once; the
    histogram of the 27 possible sequences must match plain decoding's exact distribution."""
    rng = np.random.default_rng(2024 + num_draft)
    batch = 30_000
    sequences: list[tuple[int, ...]] = [()] * batch
    while min(map(len, sequences)) < NUM_GENERATED:
        draft_tokens = np.zeros((batch, num_draft), dtype=np.int32)
        draft_probs = np.zeros((batch, num_draft, VOCAB), dtype=np.float32)
        target_probs = np.zeros((batch, num_draft + 1, VOCAB), dtype=np.float32)
        for row, prefix in enumerate(sequences):
            context = prefix
            for position in range(num_draft):
                draft_probs[row, position] = _table("q", context)
                target_probs[row, position] = _table("p", context)
                token = sample_from_distribution(draft_probs[row, position], rng.random())
                draft_tokens[row, position] = token
                context = (*context, token)
            target_probs[row, num_draft] = _table("p", context)
        _, output = mx_verify_draft_tokens(
            mx.array(target_probs),
            mx.array(draft_probs),
            mx.array(draft_tokens),
            mx.array(rng.random((batch, num_draft), dtype=np.float32)),
            mx.array(rng.random(batch, dtype=np.float32)),
        )
        output = np.array(output)
        sequences = [
            (*prefix, *(int(t) for t in row if t >= 0))[:NUM_GENERATED]
            if len(prefix) < NUM_GENERATED
            else prefix
            for prefix, row in zip(sequences, output, strict=True)
        ]
    exact = _exact_sequence_distribution()
    observed = np.zeros(len(exact))
    index = {sequence: i for i, sequence in enumerate(exact)}
    for sequence in sequences:
        observed[index[sequence]] += 1
    expected = np.array(list(exact.values())) * batch
    assert expected.sum() == pytest.approx(batch, rel=1e-6)
    assert stats.chisquare(observed, expected).pvalue > SIGNIFICANCE


def test_mlx_verify_loop_with_wrong_q_is_detected() -> None:
    """Negative control for the test above: reporting a q other than the one the draft was
    drawn from biases the output, and the same chi-square sees it."""
    rng = np.random.default_rng(99)
    batch = 30_000
    p = np.array([0.5, 0.3, 0.2], dtype=np.float32)
    q_true = np.array([0.1, 0.1, 0.8], dtype=np.float32)
    q_claimed = np.array([0.6, 0.2, 0.2], dtype=np.float32)
    tokens = np.array(
        [[sample_from_distribution(q_true, rng.random())] for _ in range(batch)], dtype=np.int32
    )
    _, output = mx_verify_draft_tokens(
        mx.array(np.broadcast_to(p, (batch, 2, 3)).copy()),
        mx.array(np.broadcast_to(q_claimed, (batch, 1, 3)).copy()),
        mx.array(tokens),
        mx.array(rng.random((batch, 1), dtype=np.float32)),
        mx.array(rng.random(batch, dtype=np.float32)),
    )
    first = np.array(output)[:, 0]
    observed = np.bincount(first, minlength=3)
    assert stats.chisquare(observed, p * batch).pvalue < 1e-20


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


def test_temperature_zero_is_argmax_with_ties_to_lowest_id() -> None:
    greedy = SamplerConfig(temperature=0)
    np.testing.assert_array_equal(
        distribution_from_logits(np.array([1.0, 3.0, 3.0]), greedy), [0, 1, 0]
    )
    np.testing.assert_array_equal(
        distribution_from_logits(np.array([3.0, 1.0, 2.0]), greedy, np.array([1, 0, 0])), [1, 0, 0]
    )
    np.testing.assert_array_equal(
        np.array(mx_distribution_from_logits(mx.array([1.0, 3.0, 3.0]), greedy)), [0, 1, 0]
    )


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-31])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """A temperature so small that logits / T overflow float32 (NaN probabilities: the MLX
    path then drew token 0, garbage or a grammar violation) samples the argmax, the limit
    of softmax(logits / T) as T -> 0."""
    config = SamplerConfig(temperature=temperature)
    assert config.is_greedy
    logits = [-50.0, 30.0, 2.0]
    np.testing.assert_array_equal(
        np.array(mx_distribution_from_logits(mx.array(logits), config)), [0, 1, 0]
    )
    np.testing.assert_array_equal(distribution_from_logits(np.array(logits), config), [0, 1, 0])


def test_temperature_scales_logits_before_softmax() -> None:
    logits = np.array([1.0, 2.0, 0.0])
    probs = distribution_from_logits(logits, SamplerConfig(temperature=0.5))
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(probs, expected, rtol=1e-12)


@pytest.mark.parametrize(
    "config",
    [
        SamplerConfig(),
        SamplerConfig(temperature=0.7, top_k=20),
        SamplerConfig(temperature=1.3, top_p=0.9),
        SamplerConfig(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05),
        SamplerConfig(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplerConfig(temperature=0.8, logit_bias={3: 4.0, 10: -100.0}, min_p=0.1),
    ],
    ids=["default", "top-k", "top-p", "all-filters", "penalties", "bias+min-p"],
)
def test_mlx_distribution_matches_numpy_reference(config: SamplerConfig) -> None:
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((16, 200)) * 3).astype(np.float32)
    counts = rng.poisson(0.3, size=(16, 200))
    expected = distribution_from_logits(logits, config, counts)
    actual = np.array(mx_distribution_from_logits(mx.array(logits), config, mx.array(counts)))
    assert (_support_mask(actual) == _support_mask(expected)).all()
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=1e-7)


def _tie_rows() -> np.ndarray:
    """Rows with ties at top-k / top-p boundaries and zeros (a reduced draft vocabulary)."""
    rng = np.random.default_rng(11)
    rows = [
        [0.125, 0.5, 0.25, 0.125, 0.0, 0.0],
        [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
        [0.0, 0.4, 0.0, 0.3, 0.3, 0.0],
        [0.6, 0.1, 0.1, 0.1, 0.1, 0.0],
    ]
    for _ in range(12):
        row = rng.choice([0.0, 1.0, 2.0, 3.0], size=6).astype(np.float64)
        row[rng.integers(6)] += 1.0
        rows.append(list(row / row.sum()))
    return np.array(rows)


@pytest.mark.parametrize("top_k", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("top_p", [1.0, 0.3, 0.5, 0.75, 0.9])
def test_mlx_filters_match_numpy_on_ties_and_zeros(top_k: int, top_p: float) -> None:
    probs = _tie_rows()
    for min_p in (0.0, 0.5):
        expected = apply_top_p_top_k(probs, top_p, top_k, min_p)
        actual = np.array(mx_apply_top_p_top_k(mx.array(probs, mx.float32), top_p, top_k, min_p))
        assert (_support_mask(actual) == _support_mask(expected)).all(), (top_k, top_p, min_p)
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_mlx_top_p_below_float32s_smallest_keeps_the_top_token(top_p: float) -> None:
    # top_p rounds to 0 in float32: the nucleus is still the most likely token (and its
    # ties), as in the float64 reference, never the whole distribution.
    probs = _tie_rows()
    for top_k in (0, 3):
        expected = apply_top_p_top_k(probs, top_p, top_k)
        actual = np.array(mx_apply_top_p_top_k(mx.array(probs, mx.float32), top_p, top_k))
        assert (_support_mask(actual) == _support_mask(expected)).all(), top_k
        assert (_support_mask(expected) == (probs == probs.max(axis=-1, keepdims=True))).all()


def _support_mask(probs: np.ndarray) -> np.ndarray:
    return probs > 0


# ---------------------------------------------------------------------------------------------
# SamplerConfig validation
# ---------------------------------------------------------------------------------------------


def test_sampler_config_defaults_match_openai() -> None:
    config = SamplerConfig()
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (1.0, 1.0, 0, 0.0)
    assert config.repetition_penalty == 1.0 and not config.logit_bias and config.seed is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 200.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"²": 1.0}),  # str.isdigit() is True, int() refuses it
        ("seed", 1.5),
        ("seed", -1),  # numpy.random.default_rng([seed, position]) refuses negatives
    ],
)
def test_invalid_sampler_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidParameter, match=field) as info:
        SamplerConfig(**{field: value})
    assert info.value.param == field and info.value.code == "invalid_value"
    assert isinstance(info.value, ValueError)  # callers catching ValueError still do


def test_sampler_config_accepts_the_largest_int64_seed() -> None:
    seed = 2**63 - 1
    assert SamplerConfig(seed=seed).seed == seed
    np.random.default_rng([seed, 5])  # what the engine does with it


def test_sampler_config_is_frozen() -> None:
    config = SamplerConfig(logit_bias={1: 1.0})
    with pytest.raises(AttributeError):
        config.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.logit_bias[2] = 1.0  # type: ignore[index]


@pytest.mark.parametrize(
    "config",
    [
        SamplerConfig(temperature=0.7, repetition_penalty=1e-300),  # 0 in float32: x / 0
        SamplerConfig(temperature=0.7, repetition_penalty=1e300),  # inf in float32: 0 * inf
        SamplerConfig(temperature=1e-29, repetition_penalty=1e-30),  # overflows through T
        SamplerConfig(temperature=1e-29, top_p=0.5),  # logits / T past float32's range
        SamplerConfig(temperature=0.0, repetition_penalty=1e300),  # greedy past the overflow
    ],
    ids=["penalty-to-zero", "penalty-to-inf", "penalty-and-tiny-T", "tiny-T", "greedy"],
)
def test_extreme_penalties_and_temperatures_give_the_references_distribution(
    config: SamplerConfig,
) -> None:
    # Seen tokens with positive, zero and negative logits, all-negative rows, ties: every
    # row a distribution (no NaN), the same support and probabilities as the float64
    # reference, which keeps its penalised logits within float32's range as well. (Values
    # that underflow float32 but not float64, e.g. -1e-300, are not in greedy rows here:
    # there the twins' dtypes themselves differ.)
    logits = np.array(
        [
            [3.0, 2.5, 0.0, -1.0, 2.5, -4.0],
            [-3.0, -2.5, -7.0, -1.0, -2.0, -4.0],
            [0.0, 0.0, 1.0, 1.0, -1.0, 5.0],
        ],
        np.float32,
    )
    counts = np.array([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 1]])
    expected = distribution_from_logits(logits, config, counts)
    actual = np.array(mx_distribution_from_logits(mx.array(logits), config, mx.array(counts)))
    assert np.isfinite(actual).all() and np.allclose(actual.sum(axis=-1), 1.0)
    assert (_support_mask(actual) == _support_mask(expected)).all()
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=1e-7)


def test_plain_sampled_decoding_writes_the_kv_stores_in_place() -> None:
    """A plain row's forward is queued before the previous one has run (its input is that
    one's lazy draw), and a layer node writes a KV store in place only when the previous
    write of that store has run by the time MLX dispatches the next: MLX decides donation
    at dispatch, and its CPU stream keeps each node's buffers until the node has run. On
    the default model each plain step's graph, with ``sample_logits``' two nodes, keeps
    MLX's host (at most ~100 dispatches ahead) off the previous step's writes: no store
    copied. One node fewer in the step copies stores in about half the requests
    (benchmarks/results/2026-12-04-store-copies/)."""
    from mtplx import fused_layer
    from mtplx.engine import Engine
    from mtplx.models import load
    from mtplx.models.gguf import ensure_default_model
    from mtplx.request import GenerationRequest, TokenEvent

    engine = Engine(load(ensure_default_model()))
    copies = fused_layer.store_copies() if fused_layer.available() else 0
    for seed in range(3):
        request = GenerationRequest(
            [1, 2, 3, 4, 5, 6, 7, 8],
            SamplerConfig(temperature=0.6, seed=seed),
            48,
            ignore_eos=True,
            drafter="none",
            depth=0,
        )
        tokens = [e for e in engine.generate(request) if isinstance(e, TokenEvent)]
        assert len(tokens) == 48
    if fused_layer.available():
        assert fused_layer.store_copies() == copies
