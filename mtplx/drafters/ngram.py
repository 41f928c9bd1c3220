"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n
tokens of the history (prompt + output). Proposals are one-hot, so q is one-hot, which the
exact rule handles (a one-hot draft is accepted with probability p(token))."""

from __future__ import annotations

import mlx.core as mx

from mtplx.drafters.base import DraftSampler


def find_continuation(
    history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2
) -> list[int]:
    """k tokens that followed the latest earlier match of the longest suffix n-gram (n from
    max_ngram down to min_ngram) of ``history``; [] when nothing matches.

    A match close to the end runs out of history; the continuation then keeps copying with
    the same period (what follows the match is assumed to repeat), so a repeating text
    still gets k proposals."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                extended = list(history)
                for offset in range(k):
                    extended.append(extended[start + n + offset])
                return extended[length:]
    return []


class NgramDrafter:
    """The n-gram prompt-lookup drafter; it keeps no model state."""

    name = "ngram"
    needs_hidden = False
    draft_vocab = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing to reset: the history is passed to ``propose``."""

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Nothing to keep in step."""

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """One-hot proposals from the history; the sampler is not consulted."""
        continuation = find_continuation(history, k, self.max_ngram, self.min_ngram)
        vocab = mx.arange(sample.vocab_size)
        tokens = [mx.array(token, dtype=mx.int32) for token in continuation]
        return tokens, [(vocab == token).astype(mx.float32) for token in tokens]
