"""The multi-draft acceptance rules against exact enumeration and seeded sampling, and the
offline position-1 distributions against what the engine's MTP drafter drafts."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from mtplx.models import load
from mtplx.request import SamplerConfig
from mtplx.train.compare import engine_run
from mtplx.train.multi_draft import (
    chain_acceptance,
    estimate,
    plain_answer,
    position_one_distributions,
    recursive_rejection_acceptance,
    recursive_rejection_sample,
    top_k_acceptance,
    verify_costs,
)

CASES = [
    (np.array([0.6, 0.3, 0.1, 0.0]), np.array([0.4, 0.4, 0.2, 0.0])),
    (np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.7, 0.0, 0.0, 0.3])),
    (np.array([0.0, 0.0, 1.0, 0.0]), np.array([0.25, 0.25, 0.25, 0.25])),
    (np.array([0.25, 0.25, 0.25, 0.25]), np.array([0.0, 1.0, 0.0, 0.0])),
]


def _enumerate(p: np.ndarray, drafts: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """Exact (output distribution, P(some draft accepted)) of the recursive rule with draft i
    drawn from drafts[i], by enumerating every draft tuple and every accept/reject branch."""
    out, accepted = np.zeros_like(p), 0.0
    vocab = range(len(p))
    for tokens in itertools.product(vocab, repeat=len(drafts)):
        weight = np.prod([q[x] for q, x in zip(drafts, tokens, strict=True)])
        if weight == 0:
            continue
        r, reach = p.copy(), weight  # reach: probability of getting to this test
        for q, x in zip(drafts, tokens, strict=True):
            a = min(1.0, r[x] / q[x])
            out[x] += reach * a
            accepted += reach * a
            reach *= 1 - a
            left = np.maximum(r - q, 0)
            if left.sum() == 0:
                break
            r = left / left.sum()
        out += reach * r
    return out, accepted


@pytest.mark.parametrize("p,q", CASES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_iid_drafts_match_enumeration(p, q, k) -> None:
    out, accepted = _enumerate(p, [q] * k)
    np.testing.assert_allclose(out, p, atol=1e-12)  # the rule keeps p
    assert recursive_rejection_acceptance(p, q, k) == pytest.approx(accepted, abs=1e-12)
    if k == 1:
        assert chain_acceptance(p, q) == pytest.approx(accepted, abs=1e-12)


@pytest.mark.parametrize("p,q", CASES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_candidates_match_enumeration(p, q, k) -> None:
    candidates = np.argsort(-q, kind="stable")[:k]
    one_hots = [np.eye(len(p))[c] for c in candidates]
    out, accepted = _enumerate(p, one_hots)
    np.testing.assert_allclose(out, p, atol=1e-12)
    assert top_k_acceptance(p, q, k) == pytest.approx(accepted, abs=1e-12)


def test_more_candidates_never_accept_less() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        p, q = rng.dirichlet(np.ones(6) * 0.5), rng.dirichlet(np.ones(6) * 0.5)
        iid = [recursive_rejection_acceptance(p, q, k) for k in range(1, 5)]
        top = [top_k_acceptance(p, q, k) for k in range(1, 5)]
        assert all(b >= a - 1e-12 for a, b in itertools.pairwise(iid))
        assert all(b >= a - 1e-12 for a, b in itertools.pairwise(top))
        assert top[-1] <= 1 + 1e-12 and iid[-1] <= 1 + 1e-12


def test_seeded_sampling_keeps_p_and_accepts_at_the_predicted_rate() -> None:
    p, q = CASES[0]
    rng = np.random.default_rng(11)
    n, k = 40_000, 2
    counts, accepted = np.zeros(len(p)), 0
    for _ in range(n):
        tokens = [int(rng.choice(len(q), p=q)) for _ in range(k)]
        token, index = recursive_rejection_sample(p, [q] * k, tokens, rng.random(k + 1))
        counts[token] += 1
        accepted += index is not None
    support = p > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], p[support] * n).pvalue > 1e-3
    expected = recursive_rejection_acceptance(p, q, k)
    assert abs(accepted / n - expected) < 4 * np.sqrt(expected * (1 - expected) / n)


@pytest.fixture(scope="module")
def model(llama_draft_vocab_checkpoint: Path):
    return load(llama_draft_vocab_checkpoint)


def test_position_one_distributions_are_what_the_engine_drafts(model) -> None:
    prompt = [5, 9, 14, 3, 77, 120, 6]
    tokens, _, drafter = engine_run(model, prompt, 1, 24)
    p, q, scores = position_one_distributions(
        model, tokens, len(prompt), SamplerConfig(temperature=0)
    )
    assert p.shape == q.shape == scores.shape
    assert p.shape == (len(tokens) - len(prompt) - 1, model.target.vocab_size)
    outside = np.ones(q.shape[1], bool)
    outside[np.array(model.draft_vocab)] = False
    assert (q[:, outside] == 0).all() and np.isneginf(scores[:, outside]).all()
    assert (np.argmax(scores, axis=1) == np.argmax(q, axis=1)).all()
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-6)
    # Every engine cycle drafted the argmax of q at its position; p is the text's own token.
    assert drafter.cycles
    for position, drafts in drafter.cycles:
        assert int(drafts[0].item()) == int(np.argmax(q[position - len(prompt) - 1]))
    answer = tokens[len(prompt) + 1 :]
    assert (np.argmax(p, axis=1) == answer).all()


def test_estimate_and_costs(model) -> None:
    prompt = [5, 9, 14, 3, 77, 120, 6]
    greedy = estimate(model, [prompt], SamplerConfig(temperature=0), 16, [1, 3])
    rates = greedy["acceptance"]
    # At T=0 a position counts when the text's token is among the head's best k logits.
    tokens = plain_answer(model, prompt, SamplerConfig(temperature=0), 16)
    _, _, scores = position_one_distributions(
        model, tokens, len(prompt), SamplerConfig(temperature=0)
    )
    truth = np.array(tokens[len(prompt) + 1 :])
    ranks = (scores > scores[np.arange(len(truth)), truth][:, None]).sum(axis=1)
    assert greedy["positions"] == len(truth)
    for k in (1, 3):
        assert rates[f"top{k}"] == pytest.approx(np.mean(ranks < k))
    # One-hot p and q: chain == top-1 == i.i.d. drafts (all the same token).
    assert rates["chain"] == pytest.approx(rates["top1"]) == pytest.approx(rates["iid3"])
    sampled = estimate(model, [prompt], SamplerConfig(temperature=0.8), 16, [2])["acceptance"]
    assert sampled["chain"] <= sampled["iid2"] + 1e-12 <= 1 + 1e-12
    costs = verify_costs(model, 3, context=20, repeats=2)
    assert set(costs) == {0, 1, 2, 3} and all(v > 0 for v in costs.values())
