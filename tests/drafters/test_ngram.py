"""Prompt lookup proposals."""

from __future__ import annotations

import random

from mtplx.drafters.ngram import LONG_MATCH, NgramDrafter, find_continuation, find_match


def test_latest_match_of_longest_ngram_is_continued() -> None:
    history = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert find_continuation(history, 2, max_ngram=3) == [7, 8]


def test_falls_back_to_shorter_ngrams() -> None:
    history = [4, 5, 6, 0, 5, 6]
    assert find_continuation(history, 3, max_ngram=3, min_ngram=2) == [0, 5, 6]
    assert find_continuation([1, 2, 3, 4], 3, max_ngram=3, min_ngram=2) == []


def test_match_near_the_end_continues_periodically() -> None:
    assert find_continuation([7, 1, 2, 1, 2], 5, max_ngram=2) == [1, 2, 1, 2, 1]
    assert find_continuation([3, 3, 3], 4, max_ngram=2) == [3, 3, 3, 3]


def test_no_proposal_for_short_history() -> None:
    assert find_continuation([5], 4) == []


def _reference_match(history: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """The plain twin of find_match: try each n from the longest, scan back for it."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return n, start + n - 1
    return 0, -1


def test_find_match_equals_its_reference_twin() -> None:
    rng = random.Random(0)
    for trial in range(3000):
        alphabet = 2 + trial % 5  # small alphabets make long, overlapping matches common
        history = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))]
        max_ngram = rng.randrange(2, 10)
        expected = _reference_match(history, max_ngram, 2)
        assert find_match(history, max_ngram, 2) == expected, (history, max_ngram)


def test_match_length_sees_long_copies() -> None:
    text = list(range(100, 120))
    drafter = NgramDrafter()
    assert drafter.match_length([*text, 7, *text[:12]]) == LONG_MATCH  # capped at max_ngram
    assert drafter.match_length([*text, 7, *text[:3]]) == 3
    assert drafter.match_length([*text, 7]) == 0


def test_rows_proposed_in_one_pass_equal_each_row_alone() -> None:
    """``propose_batch`` over lookup rows of different histories and depths (with and
    without a match, and a lookup that pads its proposals): each row's tokens and one-hot q
    are bitwise what it proposes alone."""
    import mlx.core as mx
    import numpy as np

    from mtplx.drafters.base import DraftSampler
    from mtplx.request import SamplerConfig
    from mtplx.step_timing import ScratchLookup

    vocab = 50
    rng = random.Random(5)
    drafters: list[NgramDrafter] = [NgramDrafter(), NgramDrafter(max_ngram=3), ScratchLookup()]
    drafters += [NgramDrafter() for _ in range(5)]
    histories = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in drafters]
    histories[1] = [1, 2, 3, 4, 5]  # no match: nothing proposed
    histories[2] = [9, 8, 7, 6]  # no match, padded to k by the scratch lookup
    ks = [1 + index % 5 for index in range(len(drafters))]
    samplers = [DraftSampler(SamplerConfig(temperature=0.0), vocab, mx.zeros(k)) for k in ks]
    together = drafters[0].propose_batch(list(drafters), histories, ks, samplers)  # type: ignore[arg-type]
    assert together[1] == ([], []) and len(together[2][0]) == ks[2]
    assert sum(len(tokens) for tokens, _ in together) > len(drafters)  # matches proposed
    for drafter, history, k, sampler, (tokens, qs) in zip(
        drafters, histories, ks, samplers, together, strict=True
    ):
        alone_tokens, alone_qs = drafter.propose(history, k, sampler)
        assert [t.dtype for t in tokens] == [t.dtype for t in alone_tokens]
        assert [t.item() for t in tokens] == [t.item() for t in alone_tokens]
        assert len(qs) == len(alone_qs)
        for q, alone_q in zip(qs, alone_qs, strict=True):
            assert q.dtype == alone_q.dtype == mx.float32 and q.shape == (vocab,)
            assert np.array_equal(np.array(q), np.array(alone_q))
    nothing = NgramDrafter().propose_batch([NgramDrafter()], [[1, 2]], [3], samplers[:1])  # type: ignore[list-item]
    assert nothing == [([], [])]
