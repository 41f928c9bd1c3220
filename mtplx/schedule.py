"""The schedule of a step: each decoding row's plan (draft source and depth), how the step
runs it (plain, drafting, drafting one step ahead; settling in-flight work the plan cannot
build on), and which prompt chunks ride along under the step's token budget."""

from __future__ import annotations

import dataclasses

from mtplx.drafters.lookup_first import LOOKUP
from mtplx.engine_state import EngineState, StepEvent
from mtplx.planner import Plan, StepCosts, plan_cycle
from mtplx.prefill import fixed_chunks
from mtplx.sequence import Sequence, Status
from mtplx.speculative import commits_lazily
from mtplx.step import StepBatch

__all__ = ["BESIDE_STREAMS_TOKENS", "Schedule"]

# Beside decoding streams, a step's tokens in all (decoding and prompt) stay within this many
# even where the target takes more rows a forward (``max_packed_rows``; a prompt alone then
# feeds more): the float32 invariant kernel's rows, which the streams' gaps were sized on.
BESIDE_STREAMS_TOKENS = 128


class Schedule(EngineState):
    """The decisions of a step (no forward runs here)."""

    def _plans(self, events: list[StepEvent]) -> dict[Sequence, Plan]:
        """The next cycle of every decoding row (not one whose result waits to be emitted).
        While a prompt is fed beside them, adaptive rows do not draft: the steps are long,
        and a drafting row emits nothing in the step that re-queues its plain forward,
        which would double its wait between tokens."""
        committed = self.in_flight.committed
        decoding = [s for s in self.running if s.status is Status.RUNNING and s not in committed]
        prefilling = any(s.status is Status.PREFILLING for s in self.running)
        plans = {}
        for sequence in decoding:
            try:
                plans[sequence] = self._plan(sequence, len(decoding), prefilling)
            except Exception as exc:  # one row's failure fails that request alone
                self._fail(sequence, exc, events)
        return plans

    def _plan(self, sequence: Sequence, batch_size: int, prefilling: bool = False) -> Plan:
        """The row's next cycle (a plan waiting for its ahead to close goes first)."""
        planned = self.in_flight.planned.pop(sequence, None)
        if planned is not None:
            return planned
        if prefilling and sequence.policies:
            return Plan(None, 0)
        room = min(
            sequence.request.max_tokens - sequence.num_output_tokens,
            self.context_length - len(sequence.tokens),
        )
        queued = self.in_flight.drafts.get(sequence)
        if queued is not None:  # what its verdict may still commit (0: read it)
            room = max(room - queued.draft.num_drafted - 1, 1)
        return plan_cycle(
            sequence.drafter,
            sequence.policies,
            sequence.depth,
            sequence.tokens,
            room - 1,
            self.costs if self.calibrated else None,
            batch_size,
        )

    def _schedule(self, plans: dict[Sequence, Plan], events: list[StepEvent]) -> StepBatch:
        """Sort the planned rows by how this step runs them. A row with a cycle in flight
        that this plan cannot build on settles it first (reads its verdict or its draw) and
        feeds nothing this step."""
        batch = StepBatch(plans)
        for sequence, plan in plans.items():
            pipelined = plan.num_draft > 0 and self._pipelines(sequence, plan)
            if sequence in self.in_flight.drafts and not pipelined:
                # Read the queued cycle's verdict; plan again from the history it completes.
                self._close_queued(sequence, events)
            elif plan.num_draft > 0 and sequence in self.in_flight.plain:
                # Commit the queued forward's token first; draft after it next step.
                self._close_ahead(sequence, events)
                self.in_flight.planned[sequence] = plan
            elif plan.num_draft == 0 and not sequence.config.has_penalties and not sequence.grammar:
                # Not with a grammar either: the mask needs the previous token read first.
                batch.plain.append(sequence)
            elif pipelined:
                batch.ahead.append(sequence)
            else:
                batch.drafting.append(sequence)
        return batch

    def _pipelines(self, sequence: Sequence, plan: Plan) -> bool:
        """Whether the row's drafting cycle of ``plan`` runs one step ahead: from a model
        drafter that takes lazy commits, over a target that trims lazily."""
        drafter = sequence.drafter
        return (
            self.batched.trims_lazily
            and commits_lazily(sequence)
            and drafter is not None
            and plan.source != LOOKUP
            and plan.source in drafter.sources
        )

    def priced(self, costs: StepCosts) -> StepCosts:
        """``costs`` with the draft sources whose cycles run one step ahead here."""
        ahead = []
        if self.batched.trims_lazily:
            for name, factory in self._drafters.items():
                drafter = factory() if "+" not in name else None  # one of each drafter
                if drafter is not None and drafter.commits_lazily:
                    ahead.append(name)
        return dataclasses.replace(costs, ahead=tuple(ahead))

    def _prefill_chunks(
        self, num_decode_tokens: int, idle: bool = False
    ) -> list[tuple[Sequence, list[int]]]:
        """Prompt tokens to feed in this step's forward beside ``num_decode_tokens``
        decoding ones, all within ``max_packed_rows`` (every row then stays batch-invariant)
        and, beside decoding streams, within BESIDE_STREAMS_TOKENS (a stream's gap between
        tokens grows with the step): waiting prompts share what is left, oldest first, each
        at most ``_prefill_piece`` (whole fixed chunks where the target's states depend on
        how a prompt is split: ``fixed_chunks``); at least one token a step while any prompt
        waits. ``idle``: no stream decodes."""
        rows = self.batched.max_packed_rows or self.prefill_budget  # 0: rows run alone
        if idle:  # nothing decodes, nobody waits on the step: a whole forward of prompt
            budget = min(max(self.prefill_budget, self.batched.max_prefill_tokens), rows)
        else:  # a running stream waits for the step: its tokens in all stay few
            budget = min(self.prefill_budget, min(rows, BESIDE_STREAMS_TOKENS) - num_decode_tokens)
        waiting = [s for s in self.running if s.status is Status.PREFILLING]
        if self.prefix is not None:
            for sequence in waiting:
                self.prefix.reuse(sequence)  # blocks other prompts have fed since
            waiting = [s for i, s in enumerate(waiting) if not self.prefix.fed_by(s, waiting[:i])]
        if not self.batched.resumes_anywhere:
            return fixed_chunks(waiting, budget, self.prefill_chunk_size)
        chunks: list[tuple[Sequence, list[int]]] = []
        for index, sequence in enumerate(waiting):
            # Waiting prompts share the step, so a short one behind a long one starts at once.
            share = max(budget // (len(waiting) - index), 0 if chunks else 1)
            size = min(self._prefill_piece(idle), share)
            if size <= 0:
                continue
            start = sequence.num_prefilled
            chunk = sequence.tokens[start : min(start + size, sequence.num_prompt_tokens)]
            chunks.append((sequence, chunk))
            budget -= len(chunk)
        return chunks

    def _prefill_piece(self, idle: bool) -> int:
        """How many prompt tokens a prompt feeds in one step: ``prefill_chunk_size`` beside
        decoding streams (what they wait for: a chunk's attention grows with the context
        before it), a whole forward when nothing decodes."""
        largest = self.batched.max_prefill_tokens
        return largest if idle else min(self.prefill_chunk_size, largest)
