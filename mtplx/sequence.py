"""Everything one request owns while it runs in the engine's batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import Drafter
from mtplx.models.rows import Row
from mtplx.output import TextEmitter
from mtplx.planner import Plan
from mtplx.request import (
    FinishEvent,
    GenerationRequest,
    GenerationStats,
    PromptLogprob,
    TokenEvent,
)
from mtplx.sampling import SamplerConfig

if TYPE_CHECKING:
    from mtplx.cycle import Ahead, CycleResult, QueuedDraft
    from mtplx.grammar import GrammarState

Event = TokenEvent | FinishEvent


@dataclass(eq=False)
class Sequence:
    """One request in the batch: its tokens, its row of the target, its own drafter (and its
    caches), depth policies, sampler, seed stream, penalty counts, stop rules and statistics.

    ``tokens`` is the prompt plus the committed output; the newest token is not in the target
    row yet, unless a plain forward of it is queued (``ahead``)."""

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
    pending: CycleResult | None = None  # committed, not yet emitted
    ahead: Ahead | None = None  # the queued plain forward of the newest token
    queued: QueuedDraft | None = None  # a drafting cycle whose verdict is still computing
    planned: Plan | None = None  # a drafting cycle waiting for its ahead to close
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # scored so far
    finished: bool = False
    failed: bool = False  # its state may be inconsistent: nothing of it is cached
    tag: Any = None  # the caller's handle (the scheduler's ticket and choice index)

    @property
    def config(self) -> SamplerConfig:
        """The request's sampler settings."""
        return self.request.sampler

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is in the target row (the first token is sampled)."""
        return self.num_prefilled >= self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens committed after the prompt."""
        return len(self.tokens) - self.num_prompt_tokens
