"""The MTP drafter: the checkpoint's own multi-token-prediction head.

The head's cache holds one entry per committed position i: the pair (target hidden state at
i, token x[i+1]). Committed pairs queue up and are fed in one forward when the next proposal
needs them (so cycles that draft nothing cost nothing here); that forward also yields the
logits of the first draft token. Deeper draft tokens recurse on the head's own output hidden
state and append speculative entries, which are rolled back before the next feed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtplx import cache as cache_ops
from mtplx.drafters.base import DraftSampler
from mtplx.models.base import LoadedModel, MTPHead


class MTPDrafter:
    """Drafts with ``model.mtp_heads[0]``, recursively for depth > 1."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model: LoadedModel) -> None:
        if not model.mtp_heads:
            raise ValueError(f"drafter 'mtp' needs MTP heads, and {model.path} has none")
        self.head: MTPHead = model.mtp_heads[0]
        self.draft_vocab = model.draft_vocab
        self.cache: list[Any] = []
        self.pending_hidden: list[mx.array] = []  # [1, n, H] target hidden states to feed
        self.pending_tokens: list[int] = []
        self.checkpoint: cache_ops.CacheCheckpoint | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        """Fresh head cache for a new sequence."""
        self.cache = self.head.make_cache()
        self.pending_hidden, self.pending_tokens = [], []
        self.checkpoint = None

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Queue the committed (hidden, next token) pairs."""
        if target_hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden states")
        if target_hidden.shape[1] != len(new_tokens):
            raise ValueError("one target hidden state per committed token is needed")
        self.pending_hidden.append(target_hidden)
        self.pending_tokens.extend(new_tokens)

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """k draft tokens: the first from the committed pairs, the rest by recursion."""
        if k <= 0 or not self.pending_tokens:
            return [], []
        if self.checkpoint is not None:  # drop the previous cycle's speculative entries
            cache_ops.rollback(self.cache, self.checkpoint)
        hidden_in = mx.concatenate(self.pending_hidden, axis=1)
        tokens_in = mx.array(self.pending_tokens, dtype=mx.int32)[None]
        self.pending_hidden, self.pending_tokens = [], []
        out_logits, out_hidden = self.head(hidden_in, tokens_in, self.cache)
        self.checkpoint = cache_ops.checkpoint(self.cache)
        logits, hidden = out_logits[0, -1], out_hidden[:, -1:]
        tokens, qs = [], []
        for position in range(k):
            token, q = sample(logits)
            tokens.append(token)
            qs.append(q)
            if position + 1 < k:
                out_logits, hidden = self.head(hidden, token.reshape(1, 1), self.cache)
                logits = out_logits[0, -1]
        return tokens, qs
