"""Prompt lookup proposals."""

from __future__ import annotations

from mtplx.drafters.ngram import find_continuation


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
