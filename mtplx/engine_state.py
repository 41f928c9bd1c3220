"""What every part of the engine's step reads and writes: the batch and its settings
(``EngineState``) with its work in flight (``mtplx.step.InFlight``), and the settling of
work one step ahead that both the schedule and the postprocess do (a queued drafting cycle's
verdict, a queued plain forward's draw).

``mtplx.engine.Engine`` is assembled from one class per phase, each in its module and each
on top of this one: ``Admission`` (requests in and out), ``Schedule`` (which rows run how),
``Runner`` (drafters, the forward, the acceptance rule), ``Postprocess`` (commit and emit)
over ``Prefill`` (prompt chunks and the first token).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mtplx.drafters.base import Drafter
from mtplx.events import record_cycle
from mtplx.grammar import GrammarCompiler
from mtplx.models.base import LoadedModel, TargetModel
from mtplx.models.rows import BatchedTarget
from mtplx.planner import StepCosts
from mtplx.prefix_reuse import PrefixReuse
from mtplx.sequence import Event, Sequence, Status
from mtplx.speculative import close_ahead, close_queued
from mtplx.step import InFlight

__all__ = ["EngineState", "StepEvent"]

logger = logging.getLogger("mtplx.engine")

StepEvent = tuple[Sequence, Event | BaseException]


class EngineState:
    """The engine's state, declared once for the classes of its phases (set by
    ``Engine.__init__``)."""

    model: LoadedModel
    target: TargetModel
    batched: BatchedTarget
    prefix: PrefixReuse | None
    tokenizer: Any
    model_name: str
    context_length: int
    vocab_size: int
    max_adaptive_depth: int
    max_num_seqs: int
    max_kv_bytes: int | None
    prefill_chunk_size: int
    prefill_budget: int
    keys_per_token: int  # a prompt token's products, in attention keys (prefill_cost)
    calibrated: bool
    costs: StepCosts
    default_depth: int | None
    default_drafter: str
    available_drafters: tuple[str, ...]
    eos_token_ids: set[int]
    grammars: GrammarCompiler
    running: list[Sequence]
    in_flight: InFlight  # the batch's work one step ahead, and what waits to be emitted
    num_rows_taken: int
    num_steps: int
    num_step_tokens: int
    _drafters: dict[str, Callable[[], Drafter | None]]
    _primer: int

    def _close_queued(self, sequence: Sequence, events: list[StepEvent]) -> None:
        """Commit the verdict of the row's queued drafting cycle (``close_queued``)."""
        queued = self.in_flight.drafts.pop(sequence)
        try:
            result = close_queued(self.batched, sequence, queued)
        except Exception as exc:
            self._fail(sequence, exc, events)
            return
        if queued.source in sequence.policies:
            sequence.policies[queued.source].update(result.num_drafted, result.num_accepted)
        self.in_flight.committed[sequence] = result
        record_cycle(sequence.stats, result)

    def _close_ahead(
        self, sequence: Sequence, events: list[StepEvent], started: float | None = None
    ) -> None:
        """Commit the draw of the row's queued forward (``close_ahead``)."""
        ahead = self.in_flight.plain.pop(sequence)
        try:
            result = close_ahead(sequence.drafter, ahead, started)
        except Exception as exc:
            self._fail(sequence, exc, events)
            return
        self.in_flight.committed[sequence] = result
        record_cycle(sequence.stats, result)

    def _fail(self, sequence: Sequence, exc: BaseException, events: list[StepEvent]) -> None:
        """Fail one request: it leaves the batch with its exception as its last event."""
        logger.exception("generation failed", exc_info=exc)
        sequence.status = Status.FAILED
        self.in_flight.drop(sequence)
        events.append((sequence, exc))
