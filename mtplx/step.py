"""The plain data between the three phases of ``Engine.step``'s forward, and the batch's
work in flight between steps.

``StepBatch`` is what the schedule decides (which rows decode plainly, which draft and are
verified now, which draft with their verdict queued one step ahead, which prompt chunks ride
along) and what the run fills in (the drafts, the chunks under the token budget).
``StepResults`` is what the run hands the postprocess: the verdicts to commit, the prompt
chunks' outputs, and the work queued on this forward that the next step reads.
``InFlight`` is the batch's record of that queued work (and of what is committed but not
yet emitted): a sequence has one status, and what runs one step ahead belongs to the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mtplx.cycle import Ahead, CycleResult, Draft, QueuedDraft
from mtplx.models.rows import RowOutput
from mtplx.planner import Plan
from mtplx.sequence import Sequence

__all__ = ["InFlight", "StepBatch", "StepResults"]


@dataclass(eq=False)
class InFlight:
    """The batch's work between the phases and the steps, by row: ``plain`` forwards of a
    row's newest token queued on the last forward (their draws still computing),
    ``drafts``: drafting cycles whose verdicts are still computing, ``planned``: drafting
    cycles that wait one step for the row's queued forward to close, and ``committed``:
    what a row committed this step, emitted at its end. A row is in at most one of the
    first three."""

    plain: dict[Sequence, Ahead] = field(default_factory=dict)
    drafts: dict[Sequence, QueuedDraft] = field(default_factory=dict)
    planned: dict[Sequence, Plan] = field(default_factory=dict)
    committed: dict[Sequence, CycleResult] = field(default_factory=dict)

    def __contains__(self, sequence: object) -> bool:
        """Whether work of ``sequence`` runs one step ahead (queued or planned)."""
        return sequence in self.plain or sequence in self.drafts or sequence in self.planned

    def drop(self, sequence: Sequence) -> None:
        """Forget everything of ``sequence`` (it failed or left the batch)."""
        self.plain.pop(sequence, None)
        self.drafts.pop(sequence, None)
        self.planned.pop(sequence, None)
        self.committed.pop(sequence, None)


@dataclass(eq=False)
class StepBatch:
    """One forward's rows, in forward order: ``plain`` (each feeds its queued or newest
    token), ``drafting`` (verified in this step), ``ahead`` (drafting cycles whose verdict
    is queued one step ahead), then the prompt ``chunks``."""

    plans: dict[Sequence, Plan]
    plain: list[Sequence] = field(default_factory=list)
    drafting: list[Sequence] = field(default_factory=list)
    ahead: list[Sequence] = field(default_factory=list)
    drafts: dict[Sequence, Draft] = field(default_factory=dict)
    chunks: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    started: float = 0.0  # when building the forward began (after the drafters)

    @property
    def num_decoding(self) -> int:
        """Rows that decode (every one but the prompt chunks)."""
        return len(self.plain) + len(self.drafting) + len(self.ahead)

    @property
    def rows(self) -> list[Sequence]:
        """Every row of the forward, in order."""
        return [*self.plain, *self.drafting, *self.ahead, *(s for s, _ in self.chunks)]


@dataclass(eq=False)
class StepResults:
    """What one forward produced: ``queued`` plain draws and ``queued_drafts`` run-ahead
    verdicts (both still computing), this step's ``verdicts`` (row output, number accepted,
    output tokens; evaluated), the prompt chunks' outputs, and the forward's time."""

    queued: dict[Sequence, Ahead]
    queued_drafts: dict[Sequence, QueuedDraft]
    verdicts: dict[Sequence, tuple[RowOutput, mx.array, mx.array]] = field(default_factory=dict)
    prefilled: list[RowOutput] = field(default_factory=list)
    verify_time: float = 0.0
