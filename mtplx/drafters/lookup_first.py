"""n-gram lookup first, a model drafter otherwise: the default for models that can draft.

Each cycle drafts from prompt lookup when the history has an n-gram match (free, and long
accepted runs when the output repeats its input), else from the model drafter (MTP head or
draft model). The engine decides the source before the cycle (``match_length``), keeps a
depth policy per source, and calls ``use``; committed tokens reach both drafters, so the model
drafter stays in step through lookup cycles.
"""

from __future__ import annotations

import mlx.core as mx

from mtplx.drafters.base import Drafter, DraftSampler
from mtplx.drafters.ngram import NgramDrafter

LOOKUP = "ngram"


class LookupFirstDrafter:
    """Proposes from ``lookup`` or ``model_drafter``, whichever ``use`` last named."""

    def __init__(self, lookup: NgramDrafter, model_drafter: Drafter) -> None:
        self.lookup = lookup
        self.model_drafter = model_drafter
        self.name = f"{model_drafter.name}+{LOOKUP}"
        self.sources = (LOOKUP, model_drafter.name)
        self.draft_vocab = model_drafter.draft_vocab  # the lookup ignores the draft sampler
        self.source = model_drafter.name

    @property
    def needs_hidden(self) -> bool:
        """The model drafter's need."""
        return self.model_drafter.needs_hidden

    def match_length(self, history: list[int]) -> int:
        """The lookup's match length for ``history`` (0: nothing to propose)."""
        return self.lookup.match_length(history)

    def use(self, source: str) -> None:
        """Draft the next cycle from ``source`` (one of ``sources``)."""
        if source not in self.sources:
            raise ValueError(f"unknown draft source {source!r}; sources: {self.sources}")
        self.source = source

    def reset(self, prompt_ids: list[int]) -> None:
        """Reset both drafters for a new sequence."""
        self.lookup.reset(prompt_ids)
        self.model_drafter.reset(prompt_ids)
        self.source = self.model_drafter.name

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Committed tokens reach both drafters (the lookup keeps no state)."""
        self.model_drafter.commit(new_tokens, target_hidden)

    @property
    def commits_lazily(self) -> bool:
        """Whether the model drafter queues lazy commits (``MTPDrafter.commit_lazy``)."""
        return self.model_drafter.commits_lazily

    def commit_lazy(self, tokens: mx.array, target_hidden: mx.array, num_valid: mx.array) -> None:
        """A lazy commit reaches the model drafter (the lookup reads the history)."""
        self.model_drafter.commit_lazy(tokens, target_hidden, num_valid)

    def settle(self, num_rejected: int) -> None:
        """The last lazy commit's verdict, to the model drafter."""
        self.model_drafter.settle(num_rejected)

    def active(self) -> Drafter:
        """The drafter of the current source."""
        return self.lookup if self.source == LOOKUP else self.model_drafter.active()

    @property
    def batch_key(self) -> object:
        """The current source's (proposing goes to ``active``)."""
        return self.active().batch_key

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Up to k draft tokens from the current source."""
        return self.active().propose(history, k, sample)

    def propose_batch(
        self,
        drafters: list[Drafter],
        histories: list[list[int]],
        ks: list[int],
        samplers: list[DraftSampler],
    ) -> list[tuple[list[mx.array], list[mx.array]]]:
        """The current source's ``propose_batch`` over the rows' active drafters."""
        actives = [d.active() for d in drafters]
        return self.active().propose_batch(actives, histories, ks, samplers)
