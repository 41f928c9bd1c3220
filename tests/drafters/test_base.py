"""The draft sampler over a reduced draft vocabulary at temperature 0: the token is the first
maximum of the head's logits, mapped to the full vocabulary, and q its one-hot, as a NumPy
reference computes them (ties and infinities included)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.drafters.base import DraftSampler
from mtplx.request import SamplerConfig

VOCAB = 300


def _logits(case: str) -> np.ndarray:
    rng = np.random.default_rng(len(case))
    logits = rng.standard_normal(64).astype(np.float32)
    if case == "tie":
        logits[[5, 9, 40]] = logits.max() + 1.0  # the first of equal maxima wins
    elif case == "infinite":
        logits[:] = -np.inf
        logits[[7, 30]] = [np.inf, np.inf]
    elif case == "coarse":
        logits = np.round(logits)
    return logits


@pytest.mark.parametrize("case", ["random", "tie", "infinite", "coarse"])
def test_greedy_draft_over_a_draft_vocabulary_is_the_first_maximum(case: str) -> None:
    logits = _logits(case)
    draft_vocab = np.random.default_rng(1).permutation(VOCAB)[: logits.size].astype(np.int32)
    sampler = DraftSampler(
        SamplerConfig(temperature=0.0), VOCAB, mx.zeros((1,)), None, mx.array(draft_vocab)
    )
    token, q = sampler(mx.array(logits))
    want = int(draft_vocab[int(np.argmax(logits))])
    assert int(token.item()) == want
    assert token.dtype == mx.int32
    expected_q = np.zeros(VOCAB, np.float32)
    expected_q[want] = 1.0
    np.testing.assert_array_equal(np.array(q), expected_q)
