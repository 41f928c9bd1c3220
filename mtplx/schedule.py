"""The schedule of a step: each decoding row's plan (draft source and depth), how the step
runs it (plain, drafting, drafting one step ahead; settling in-flight work the plan cannot
build on), and which prompt chunks ride along under the step's budget (in cost beside
decoding streams: ``mtplx.prefill_cost``)."""

from __future__ import annotations

import dataclasses

from mtplx.drafters.lookup_first import LOOKUP
from mtplx.engine_state import EngineState, StepEvent
from mtplx.planner import Plan, StepCosts, plan_cycle, sampling_kind
from mtplx.prefill import fixed_chunks
from mtplx.prefill_cost import affordable_tokens, chunk_cost
from mtplx.sequence import Sequence, Status
from mtplx.speculative import commits_lazily
from mtplx.step import StepBatch

__all__ = ["BESIDE_STREAMS_TOKENS", "Schedule"]

# Beside decoding streams, a step costs at most what this many tokens (decoding and prompt)
# cost at an empty context, even where the target takes more rows a forward
# (``max_packed_rows``; a prompt alone then feeds more): the float32 invariant kernel's rows,
# which the streams' gaps were sized on. Prompt tokens deep in a long prompt cost more
# (``mtplx.prefill_cost``).
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
            sampling_kind(sequence.config),  # a sampled row: priced by its sampled cycles
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
        decoding ones, all within ``max_packed_rows`` (every row then stays batch-invariant).
        Beside decoding streams (a stream's gap between tokens grows with the step), the
        prompts share a budget in cost, not tokens: what BESIDE_STREAMS_TOKENS tokens cost
        at an empty context, less the decoding tokens (``mtplx.prefill_cost``: a chunk's
        attention grows with the context before it, so four prompts thousands of tokens
        deep feed fewer tokens than one short one). Each waiting prompt takes an equal
        share of what is left, oldest first, at most ``_prefill_piece`` tokens (whole fixed
        chunks where the target's states depend on how a prompt is split: ``fixed_chunks``);
        at least one token a step while any prompt waits: where no share buys a token, one
        goes to each waiting prompt in turn. ``idle``: no stream decodes (a whole forward of
        prompt, by tokens)."""
        rows = self.batched.max_packed_rows or self.prefill_budget  # 0: rows run alone
        budget: int | None = None  # the step's cost left, in attention keys (None: tokens bind)
        if idle:  # nothing decodes, nobody waits on the step: a whole forward of prompt
            tokens = min(max(self.prefill_budget, self.batched.max_prefill_tokens), rows)
        else:  # a running stream waits for the step: its cost in all stays bounded
            tokens = min(self.prefill_budget, min(rows, BESIDE_STREAMS_TOKENS) - num_decode_tokens)
            budget = tokens * self.keys_per_token
        waiting = self._waiting_prompts()
        if not self.batched.resumes_anywhere:
            if budget is None:
                return fixed_chunks(waiting, tokens, self.prefill_chunk_size)
            return fixed_chunks(waiting, budget, self.prefill_chunk_size, self._chunk_cost)
        chunks: list[tuple[Sequence, list[int]]] = []
        for index, sequence in enumerate(waiting):
            # Waiting prompts share the step, so a short one behind a long one starts at once.
            left = len(waiting) - index
            start = sequence.num_prefilled
            size = min(
                self._prefill_piece(idle), tokens // left, sequence.num_prompt_tokens - start
            )
            if budget is not None:
                size = affordable_tokens(start, budget // left, self.keys_per_token, size)
                budget -= chunk_cost(start, size, self.keys_per_token)
            if size > 0:
                chunks.append((sequence, sequence.tokens[start : start + size]))
                tokens -= size
        if waiting and not chunks:  # one token a step whatever it costs, to each in turn
            sequence = waiting[self.num_steps % len(waiting)]
            start = sequence.num_prefilled
            chunks.append((sequence, sequence.tokens[start : start + 1]))
        return chunks

    def _waiting_prompts(self) -> list[Sequence]:
        """The prompts to feed, oldest first: cached blocks reused first, and a prompt whose
        next block an older waiting prompt feeds now waits for it."""
        waiting = [s for s in self.running if s.status is Status.PREFILLING]
        if self.prefix is not None:
            for sequence in waiting:
                self.prefix.reuse(sequence)  # blocks other prompts have fed since
            waiting = [s for i, s in enumerate(waiting) if not self.prefix.fed_by(s, waiting[:i])]
        return waiting

    def _chunk_cost(self, sequence: Sequence, size: int) -> int:
        """What feeding the prompt's next ``size`` tokens costs the step, in attention keys."""
        return chunk_cost(sequence.num_prefilled, size, self.keys_per_token)

    def _prefill_piece(self, idle: bool) -> int:
        """How many prompt tokens a prompt feeds in one step: ``prefill_chunk_size`` beside
        decoding streams (what they wait for: a chunk's attention grows with the context
        before it), a whole forward when nothing decodes."""
        largest = self.batched.max_prefill_tokens
        return largest if idle else min(self.prefill_chunk_size, largest)
