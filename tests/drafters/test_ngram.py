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
