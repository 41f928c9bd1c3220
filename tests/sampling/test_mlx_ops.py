"""The MLX twins (``mtplx.sampling.mlx_ops``) against the plain references: the verdict
decision for decision, the greedy verdict against the general rule, the draw, the
distribution and its filters (ties, zeros, extreme penalties and temperatures); and the
verdict's output over repeated draft / verify steps distributed as plain decoding."""

from __future__ import annotations

import itertools
import math
from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mtplx.request import SamplerConfig
from mtplx.sampling.mlx_ops import (
    mx_apply_top_p_top_k,
    mx_distribution_from_logits,
    mx_sample,
    mx_verify_draft_tokens,
    mx_verify_greedy,
)
from mtplx.sampling.reference import (
    apply_top_p_top_k,
    distribution_from_logits,
    sample_from_distribution,
    verify_draft_tokens_reference,
)

# A fixed significance for every chi-square test: with fixed seeds each test is deterministic,
# and a real bias of the size these sample counts can see gives p-values far below it.
SIGNIFICANCE = 1e-3


# ---------------------------------------------------------------------------------------------
# The verdict: identical to the NumPy twin, exact over several positions
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
# The distribution: filters, penalties, temperature, as the reference
# ---------------------------------------------------------------------------------------------


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
