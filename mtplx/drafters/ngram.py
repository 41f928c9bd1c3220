"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n
tokens of the history (prompt + output). Proposals are one-hot, so q is one-hot, which the
exact rule handles (a one-hot draft is accepted with probability p(token))."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx

from mtplx.drafters.base import CommitsEagerly, DraftSampler, OneSource

if TYPE_CHECKING:
    from mtplx.drafters.base import Drafter

# A match of this many tokens marks a copy of earlier text (a repeat, an edit, a quote): on
# the bench's greedy outputs its next 5 proposals were accepted 4.3-4.9 times, against
# 0.8-1.6 for 2-4 token matches in chat and code answers (those are common phrases).
LONG_MATCH = 8

# The ``batch_key`` of every lookup drafter: all the rows that draft from lookup in a step
# propose in one pass (``NgramDrafter.propose_batch``).
LOOKUP_PASS = "ngram lookup"


def find_match(history: list[int], max_ngram: int = 3, min_ngram: int = 2) -> tuple[int, int]:
    """(n, end): the longest suffix n-gram of ``history`` (min_ngram <= n <= max_ngram) that
    also occurs earlier, and where its latest earlier occurrence ends; (0, -1) when none."""
    last = len(history) - 1
    best, best_end = 0, -1
    for end in range(last - 1, -1, -1):
        if history[end] != history[last]:
            continue
        n = 1
        while n < max_ngram and end - n >= 0 and history[end - n] == history[last - n]:
            n += 1
        if n > best:  # strictly longer: among equal matches the latest wins
            best, best_end = n, end
            if n == max_ngram:
                break
    return (best, best_end) if best >= min_ngram else (0, -1)


def find_continuation(
    history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2
) -> list[int]:
    """k tokens that followed the latest earlier match of the longest suffix n-gram (n from
    max_ngram down to min_ngram) of ``history``; [] when nothing matches.

    A match close to the end runs out of history; the continuation then keeps copying with
    the same period (what follows the match is assumed to repeat), so a repeating text
    still gets k proposals."""
    n, end = find_match(history, max_ngram, min_ngram)
    if not n:
        return []
    followed = history[end + 1 :]
    continuation: list[int] = []
    for offset in range(k):
        copied = offset < len(followed)
        continuation.append(followed[offset] if copied else continuation[offset - len(followed)])
    return continuation


def one_hot_proposals(tokens: list[int], vocab_size: int) -> tuple[list[mx.array], list[mx.array]]:
    """Draft tokens as scalar int32 arrays with their one-hot q ([V] float32 each)."""
    vocab = mx.arange(vocab_size)
    drafted = [mx.array(token, dtype=mx.int32) for token in tokens]
    return drafted, [(vocab == token).astype(mx.float32) for token in drafted]


def one_hot_rows(
    continuations: list[list[int]], vocab_size: int
) -> list[tuple[list[mx.array], list[mx.array]]]:
    """``one_hot_proposals`` of many rows' tokens from one array of all their ids and one
    one-hot product over it (the same values: a one-hot row is exact)."""
    flat = [token for tokens in continuations for token in tokens]
    if not flat:
        return [([], []) for _ in continuations]
    ids = mx.array(flat, dtype=mx.int32)  # [N]
    one_hot = (mx.arange(vocab_size)[None] == ids[:, None]).astype(mx.float32)  # [N, V]
    proposals = []
    start = 0
    for tokens in continuations:
        rows = range(start, start + len(tokens))
        proposals.append(([ids[i] for i in rows], [one_hot[i] for i in rows]))
        start += len(tokens)
    return proposals


class NgramDrafter(CommitsEagerly, OneSource):
    """The n-gram prompt-lookup drafter; it keeps no model state. Every lookup drafter
    proposes with the others of a step in one pass (``batch_key``)."""

    name = "ngram"
    needs_hidden = False
    draft_vocab = None
    batch_key: object = LOOKUP_PASS

    def __init__(self, max_ngram: int = LONG_MATCH, min_ngram: int = 2) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def match_length(self, history: list[int]) -> int:
        """Length of the longest suffix n-gram of ``history`` that occurs earlier (at most
        ``max_ngram``); 0 when lookup has nothing to propose."""
        return find_match(history, self.max_ngram, self.min_ngram)[0]

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing to reset: the history is passed to ``propose``."""

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Nothing to keep in step."""

    def continuation(self, history: list[int], k: int) -> list[int]:
        """The (up to k) token ids it proposes after ``history``."""
        return find_continuation(history, k, self.max_ngram, self.min_ngram)

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """One-hot proposals from the history; the sampler is not consulted."""
        return one_hot_proposals(self.continuation(history, k), sample.vocab_size)

    def active(self) -> Drafter:
        """It drafts every cycle itself."""
        return cast("Drafter", self)

    def propose_batch(
        self,
        drafters: list[Drafter],
        histories: list[list[int]],
        ks: list[int],
        samplers: list[DraftSampler],
    ) -> list[tuple[list[mx.array], list[mx.array]]]:
        """``propose`` of many lookup drafters in one pass: each row's continuation, then
        one one-hot product for all of them (each row's proposal bitwise its own)."""
        lookups = [cast(NgramDrafter, d) for d in drafters]
        vocab_sizes = {sample.vocab_size for sample in samplers}
        assert len(vocab_sizes) == 1, "rows of one step share the vocabulary"
        continuations = [
            lookup.continuation(history, k)
            for lookup, history, k in zip(lookups, histories, ks, strict=True)
        ]
        return one_hot_rows(continuations, vocab_sizes.pop())
