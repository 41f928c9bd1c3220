"""The draft-model drafter: a separate small model with the same tokenizer, or the target's
own first layers (layer-skip self-draft). Its cache holds the committed history except the
newest token, which the next proposal feeds first."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtplx import cache as cache_ops
from mtplx.arrays import scalar_int
from mtplx.drafters.base import CommitsEagerly, DraftSampler, OneSource, ProposesAlone
from mtplx.models.base import TargetModel


class DraftModelDrafter(CommitsEagerly, OneSource, ProposesAlone):
    """Drafts autoregressively with ``draft``, a TargetModel sharing the target's vocabulary."""

    name = "draft_model"
    needs_hidden = False
    draft_vocab = None

    def __init__(self, draft: TargetModel) -> None:
        self.draft = draft
        self.cache: list[Any] = []
        self.pending: list[int] = []  # committed tokens not yet in the draft cache
        self.checkpoint: cache_ops.CacheCheckpoint | None = None
        self.num_speculative = 0  # draft tokens fed to the cache after the checkpoint
        self.speculative_tokens: list[mx.array] = []

    def reset(self, prompt_ids: list[int]) -> None:
        """Fresh draft cache for a new sequence."""
        self.cache = self.draft.make_cache()
        self.pending = [int(prompt_ids[0])]
        self.checkpoint = None
        self.num_speculative = 0

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Keep the draft cache entries the committed tokens confirm; queue the rest."""
        if self.checkpoint is None:
            self.pending.extend(new_tokens)
            return
        # The cache holds [..., last committed, d1 .. d_s] with s = num_speculative. The first
        # tokens of new_tokens that equal d1.. are already in it; the remainder is pending.
        num_kept = 0
        if cache_ops.is_trimmable(self.cache):
            speculative = [scalar_int(token) for token in self.speculative_tokens]
            while (
                num_kept < min(self.num_speculative, len(new_tokens))
                and speculative[num_kept] == new_tokens[num_kept]
            ):
                num_kept += 1
            cache_ops.trim(self.cache, self.num_speculative - num_kept)
        else:
            cache_ops.rollback(self.cache, self.checkpoint)
        self.pending = list(new_tokens[num_kept:])
        self.checkpoint = None
        self.num_speculative = 0

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Feed the pending committed tokens, then draft k tokens one forward each."""
        if k <= 0:
            return [], []
        logits, _ = self.draft(mx.array(self.pending, dtype=mx.int32)[None], self.cache)
        self.pending = []
        self.checkpoint = cache_ops.checkpoint(self.cache)
        tokens, qs = [], []
        for position in range(k):
            token, q = sample(logits[0, -1])
            tokens.append(token)
            qs.append(q)
            if position + 1 < k:
                logits, _ = self.draft(token.reshape(1, 1), self.cache)
        self.num_speculative = k - 1
        self.speculative_tokens = tokens[:-1]
        return tokens, qs
