"""The MTP drafter: the checkpoint's own multi-token-prediction head.

The head's cache holds one entry per committed position i: the pair (target hidden state at
i, token x[i+1]). Committed pairs queue up and are fed in one forward when the next proposal
needs them (so cycles that draft nothing cost nothing here); that forward also yields the
logits of the first draft token. Deeper draft tokens recurse on the head's own output hidden
state and append speculative entries, which are rolled back before the next feed.

The drafters of one head propose together (``propose_batch``): each depth is one
``MTPHead.forward_rows`` over every row still drafting, the products shared, each row's
cache its own, so a row drafts bitwise what it drafts alone.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

from mtplx import cache as cache_ops
from mtplx.drafters.base import Drafter, DraftSampler, OneSource
from mtplx.models.base import LoadedModel, MTPHead
from mtplx.models.base import position as at_position
from mtplx.models.fused_head import fuse_head

# Queued pairs past this many (a prompt's, at its first draft) reach the head's cache in
# chunks of this many: one head forward over thousands of pairs would hold an attention
# score matrix of their count squared per head (GBs for a prompt of a few thousand tokens).
CATCH_UP_CHUNK = 256


class MTPDrafter(OneSource):
    """Drafts with ``model.mtp_heads[0]``, recursively for depth > 1."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model: LoadedModel) -> None:
        if not model.mtp_heads:
            raise ValueError(f"drafter 'mtp' needs MTP heads, and {model.path} has none")
        self.head: MTPHead = model.mtp_heads[0]
        fuse_head(self.head)  # its step on the fused kernels where they serve it (same bits)
        self.draft_vocab = model.draft_vocab
        self.commits_lazily = self.head.make_lazy_cache() is not None
        self.cache: list[Any] = []
        self.pending_hidden: list[mx.array] = []  # [1, n, H] target hidden states to feed
        self.pending_tokens: list[mx.array] = []  # [n] int32 the tokens after them
        # The last pending batch's pairs that hold ([] int32, lazy), None: all of them.
        self.pending_valid: mx.array | None = None
        self.num_fed_unsettled = 0  # lazy commits fed to the head, their verdicts unread
        self.checkpoint: Any = None
        self._last_size = 0  # pairs in the last batch taken by ``_feed``
        # What ``_feed`` took: a lazy cache's offset before the pairs ([] int32) and their count.
        self._fed: tuple[mx.array | None, int] = (None, 0)

    def reset(self, prompt_ids: list[int]) -> None:
        """Fresh head cache for a new sequence."""
        lazy = self.head.make_lazy_cache() if self.commits_lazily else None
        self.cache = self.head.make_cache() if lazy is None else lazy
        self.pending_hidden, self.pending_tokens, self.pending_valid = [], [], None
        self.num_fed_unsettled = 0
        self.checkpoint = None

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Queue the committed (hidden, next token) pairs."""
        if target_hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden states")
        if target_hidden.shape[1] != len(new_tokens):
            raise ValueError("one target hidden state per committed token is needed")
        if self.pending_valid is not None:
            raise RuntimeError("a lazy commit is pending: settle it first")
        self.pending_hidden.append(target_hidden)
        self.pending_tokens.append(mx.array(new_tokens, mx.int32))

    def commit_lazy(self, tokens: mx.array, target_hidden: mx.array, num_valid: mx.array) -> None:
        """Queue a cycle's pairs before its verdict is read: tokens [n] int32 and
        target_hidden [1, n, H], of which the first ``num_valid`` ([] int32, lazy) hold."""
        if not self.commits_lazily or self.pending_valid is not None:
            raise RuntimeError("this head cannot queue a lazy commit now")
        self.pending_hidden.append(target_hidden)
        self.pending_tokens.append(tokens.astype(mx.int32))
        self.pending_valid = num_valid.astype(mx.int32)

    def settle(self, num_rejected: int) -> None:
        """The verdict of the oldest unsettled lazy commit was read: ``num_rejected`` of its
        pairs do not hold."""
        if not self.num_fed_unsettled:  # not fed yet: keep the pairs that hold
            keep = int(self.pending_tokens[-1].shape[0]) - num_rejected
            self.pending_hidden[-1] = self.pending_hidden[-1][:, :keep]
            self.pending_tokens[-1] = self.pending_tokens[-1][:keep]
            self.pending_valid = None
            return
        self.num_fed_unsettled -= 1
        cache = self.cache[0]
        cache.settle(num_rejected)
        if self.checkpoint is not None:
            offset, bound = self.checkpoint
            self.checkpoint = (offset, bound - num_rejected)

    @property
    def batch_key(self) -> object:
        """Drafters of one head propose together (``propose_batch``)."""
        return self.head

    def active(self) -> MTPDrafter:
        """It drafts every cycle itself."""
        return self

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """k draft tokens: the first from the committed pairs, the rest by recursion."""
        return self.propose_batch([self], [history], [k], [sample])[0]

    def propose_batch(
        self,
        drafters: list[Drafter],
        histories: list[list[int]],
        ks: list[int],
        samplers: list[DraftSampler],
    ) -> list[tuple[list[mx.array], list[mx.array]]]:
        """``propose`` for many drafters of this head at once: each depth's head step of
        every row still drafting in one ``forward_rows`` (the first feeds each row's
        committed pairs, the rest recurse on the row's own output). A row's draft is
        bitwise what it proposes alone: rows share the products, never their caches."""
        rows = [cast(MTPDrafter, d) for d in drafters]
        drafts: list[tuple[list[mx.array], list[mx.array]]] = [([], []) for _ in rows]
        live = [
            i for i, (d, k) in enumerate(zip(rows, ks, strict=True)) if k > 0 and d.pending_tokens
        ]
        if not live:
            return drafts
        fed = [rows[i]._feed() for i in live]
        outputs = self.head.forward_rows(
            [hidden for hidden, _, _, _ in fed],
            [tokens for _, tokens, _, _ in fed],
            [rows[i].cache for i in live],
            at=[last for _, _, _, last in fed],  # only the last valid pair's logits are read
        )
        state = {
            i: rows[i]._first(out_logits, out_hidden, valid, last)
            for i, (_, _, valid, last), (out_logits, out_hidden) in zip(
                live, fed, outputs, strict=True
            )
        }  # row -> (logits of V' values, hidden [1, 1, H]) at its next draft position
        for position in range(max(ks[i] for i in live)):
            deeper = []
            for i in [i for i in live if position < ks[i]]:
                token, q = samplers[i](state[i][0])
                drafts[i][0].append(token)
                drafts[i][1].append(q)
                if position + 1 < ks[i]:
                    deeper.append((i, token))
            if not deeper:
                break
            outputs = self.head.forward_rows(
                [state[i][1] for i, _ in deeper],
                [token.reshape(1, 1) for _, token in deeper],
                [rows[i].cache for i, _ in deeper],
            )
            for (i, _), (out_logits, out_hidden) in zip(deeper, outputs, strict=True):
                state[i] = (out_logits[0, -1], out_hidden)
        return drafts

    def _feed(self) -> tuple[mx.array, mx.array, mx.array | None, mx.array]:
        """Drop the previous cycle's speculative entries and take the queued pairs:
        (hidden [1, n, H], tokens [1, n] int32, the last batch's valid count or None, []
        int32 the last valid pair's index among the n, lazy where the count is)."""
        if self.checkpoint is not None:
            if self.commits_lazily:
                self.cache[0].rollback(self.checkpoint)
            else:
                cache_ops.rollback(self.cache, self.checkpoint)
        start = self.cache[0].offset if self.commits_lazily else None
        hidden_in = mx.concatenate(self.pending_hidden, axis=1)
        tokens_in = mx.concatenate(self.pending_tokens)[None]
        valid = self.pending_valid
        if valid is None:
            hidden_in, tokens_in = self._catch_up(hidden_in, tokens_in)
        self._last_size = int(self.pending_tokens[-1].shape[0])
        self.pending_hidden, self.pending_tokens, self.pending_valid = [], [], None
        count = int(tokens_in.shape[1])
        self._fed = (start, count)
        if valid is None:
            last = mx.array(count - 1, mx.int32)
        else:  # the pairs past the valid ones of the last batch (fed last) do not hold
            last = valid + (count - 1 - self._last_size)
        return hidden_in, tokens_in, valid, last

    def _catch_up(self, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Feed all but the last (at most CATCH_UP_CHUNK) of the queued pairs to the head's
        cache, CATCH_UP_CHUNK at a time from the first, each chunk evaluated before the
        next is built; returns the pairs left (hidden [1, r, H], tokens [1, r]). The
        chunks' boundaries depend only on the pairs queued, so a prompt's cache is the
        same however it was prefilled (cold or from the prefix cache)."""
        count = int(tokens.shape[1])
        left = (count - 1) % CATCH_UP_CHUNK + 1
        for start in range(0, count - left, CATCH_UP_CHUNK):
            end = start + CATCH_UP_CHUNK
            ((_, out_hidden),) = self.head.forward_rows(
                [hidden[:, start:end]], [tokens[:, start:end]], [self.cache]
            )
            mx.eval(out_hidden)  # the cache's update with it; the chunk's logits are unused
        return hidden[:, count - left :], tokens[:, count - left :]

    def _first(
        self,
        out_logits: mx.array,
        out_hidden: mx.array,
        valid: mx.array | None,
        last: mx.array,
    ) -> tuple[mx.array, mx.array]:
        """After the fed pairs' head step (out_logits [1, 1, V'] of the fed pair ``last``
        [] int32, out_hidden [1, n, H]): the logits (out_logits itself: the sampler reads
        them flat, a reshape node only where its rule needs one) and hidden [1, 1, H] at
        the last pair that holds; checkpoint the cache before the speculative entries."""
        logits = out_logits
        if valid is None:
            hidden = out_hidden[:, -1:]
        else:  # the pairs past the valid ones leave the cache; read the last valid one's
            start, count = self._fed
            assert start is not None
            kept = valid if count == self._last_size else valid + (count - self._last_size)
            self.cache[0].keep_lazily(start, kept)
            self.num_fed_unsettled += 1
            hidden = at_position(out_hidden, last)  # [1, 1, H]
        if self.commits_lazily:
            self.checkpoint = self.cache[0].checkpoint()
        else:
            self.checkpoint = cache_ops.checkpoint(self.cache)
        return logits, hidden
