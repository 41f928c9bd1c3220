"""Everything one request owns while it runs in the engine's batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import Drafter
from mtplx.models.rows import Row
from mtplx.output import TextEmitter
from mtplx.request import (
    FinishEvent,
    GenerationRequest,
    GenerationStats,
    PromptLogprob,
    SamplerConfig,
    TokenEvent,
)

if TYPE_CHECKING:
    from mtplx.grammar import GrammarState

Event = TokenEvent | FinishEvent


class Status(Enum):
    """Where a sequence is in its life: its prompt being fed, decoding, or done."""

    PREFILLING = "prefilling"  # prompt chunks still to feed; nothing sampled yet
    RUNNING = "running"  # the first token is sampled: it decodes a cycle a step
    FINISHED = "finished"  # stopped, cut at its length, or cancelled: it leaves the batch
    FAILED = "failed"  # an error ended it; its state may be inconsistent: nothing is cached


@dataclass(eq=False)
class Sequence:
    """One request in the batch: its tokens, its row of the target, its own drafter (and its
    caches), depth policies, sampler, seed stream, penalty counts, stop rules, statistics and
    its one ``status``. What is in flight for it one step ahead (a queued forward, a queued
    verdict) is the batch's (``mtplx.step.InFlight``), not the sequence's.

    ``tokens`` is the prompt plus the committed output; the newest token is not in the target
    row yet, unless the batch has a plain forward of it queued."""

    request: GenerationRequest
    tokens: list[int]
    num_prompt_tokens: int
    row: Row
    seed: int  # the request's own random stream: see speculative.cycle_uniforms
    drafter: Drafter | None
    policies: dict[str, AdaptiveDepth]  # empty: a fixed depth
    depth: int | None
    emitter: TextEmitter
    stop_ids: set[int]
    stats: GenerationStats
    token_counts: mx.array | None = None  # [V] output token counts, when penalties are on
    grammar: GrammarState | None = None  # the constraint's state after the committed tokens
    num_prefilled: int = 0  # prompt tokens already in the target row
    prefill_hidden: list[mx.array] = field(default_factory=list)  # [T, H] chunks, for drafters
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # scored so far
    status: Status = Status.PREFILLING
    tag: Any = None  # the caller's handle (the scheduler's ticket and choice index)

    @property
    def config(self) -> SamplerConfig:
        """The request's sampler settings."""
        return self.request.sampler

    @property
    def prefilled(self) -> bool:
        """Whether its prompt is done with (fed and the first token sampled, or it ended)."""
        return self.status is not Status.PREFILLING

    @property
    def finished(self) -> bool:
        """Whether it is done (finished or failed): it leaves the batch after this step."""
        return self.status is Status.FINISHED or self.status is Status.FAILED

    @property
    def failed(self) -> bool:
        """Whether an error ended it (nothing of it is cached)."""
        return self.status is Status.FAILED

    @property
    def num_output_tokens(self) -> int:
        """Tokens committed after the prompt."""
        return len(self.tokens) - self.num_prompt_tokens
