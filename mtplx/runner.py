"""The run of a step: the drafters propose (one proposal per draft source for all its
rows), the ONE target forward over every row's tokens and the prompt chunks, the plain
rows' draws and run-ahead cycles queued lazily, and the exact rule for this step's
verdicts."""

from __future__ import annotations

import time

import mlx.core as mx

from mtplx.engine_state import EngineState, StepEvent
from mtplx.models.rows import RowOutput
from mtplx.planner import draft_source
from mtplx.prefill import chunk_logits
from mtplx.proposing import propose_rows
from mtplx.sequence import Sequence
from mtplx.speculative import (
    last_committed,
    plain_input,
    queue_draft,
    queue_plain_rows,
    verify_rows,
)
from mtplx.step import StepBatch, StepResults

__all__ = ["Runner"]


class Runner(EngineState):
    """What a step computes."""

    def _propose(self, batch: StepBatch, events: list[StepEvent]) -> None:
        """Every drafting row's drafter proposes (left lazy; evaluated ahead of the forward
        where that does not stall behind a queued cycle)."""
        rows: list[tuple[Sequence, int]] = []
        for group in (batch.drafting, batch.ahead):
            for sequence in list(group):
                plan = batch.plans[sequence]
                try:
                    drafter = sequence.drafter
                    if drafter is not None and (use := draft_source(drafter, plan)) is not None:
                        drafter.use(use)
                    rows.append((sequence, plan.num_draft))
                except Exception as exc:
                    group.remove(sequence)
                    self._fail(sequence, exc, events)
        proposed = propose_rows(rows, self.vocab_size, self.in_flight.drafts)
        for (sequence, _), draft in zip(rows, proposed, strict=True):
            if isinstance(draft, Exception):
                for group in (batch.drafting, batch.ahead):
                    if sequence in group:
                        group.remove(sequence)
                self._fail(sequence, draft, events)
            else:
                batch.drafts[sequence] = draft
        if batch.drafts:
            proposals = [(d.tokens, d.qs) for d in batch.drafts.values()]
            if not any(s in self.in_flight.drafts for s in batch.ahead):
                # The drafters compute while the forward's graph is built on top of them. Not
                # behind a queued cycle: MLX lets the host run only ~100 kernel dispatches
                # ahead, so evaluating now would wait for that cycle to all but finish.
                mx.async_eval(proposals)
        batch.started = time.perf_counter()

    def _inputs(self, batch: StepBatch) -> list[mx.array]:
        """Every decoding row's tokens for the forward, in ``batch.rows`` order (the prompt
        chunks, scheduled into what these leave of the step's budget, follow them)."""
        inputs = [plain_input(s, self.in_flight.plain.get(s)) for s in batch.plain]
        for sequence in batch.drafting:
            draft = batch.drafts[sequence]
            if self.batched.recurrent and draft.num_drafted:
                draft.checkpoint = self.batched.checkpoint(sequence.row)
            inputs.append(draft.inputs(sequence.tokens[-1]))
        queued = self.in_flight.drafts
        return inputs + [
            batch.drafts[s].inputs(last_committed(s, queued.get(s))) for s in batch.ahead
        ]

    def _execute(
        self, batch: StepBatch, inputs: list[mx.array], events: list[StepEvent]
    ) -> StepResults | None:
        """The batch's one forward; plain rows' draws and run-ahead cycles queued lazily,
        this step's verdicts evaluated. None: the forward failed, and every row in it."""
        wanted = ["all"] * batch.num_decoding + [
            chunk_logits(s, len(chunk)) for s, chunk in batch.chunks
        ]
        try:
            outputs = self.batched.forward([s.row for s in batch.rows], inputs, wanted)
            results = self._queue_ahead(batch, outputs)
            decoded = outputs[len(batch.plain) : len(batch.plain) + len(batch.drafting)]
            if any(s.grammar is not None for s in batch.drafting):
                # Compute the forward while verify works out the grammar masks on the CPU.
                mx.async_eval([output.logits for output in decoded])
            rows = [(s, batch.drafts[s], o) for s, o in zip(batch.drafting, decoded, strict=True)]
            for (sequence, _, output), verdict in zip(rows, verify_rows(rows), strict=True):
                results.verdicts[sequence] = (output, *verdict)
            results.prefilled = outputs[batch.num_decoding :]
            if results.verdicts or results.prefilled:
                mx.eval(
                    [
                        (o.hidden, accepted, tokens)
                        for o, accepted, tokens in results.verdicts.values()
                    ],
                    [(out.hidden, out.logits) for out in results.prefilled],
                    self.batched.unevaluated(),
                )
        except Exception as exc:  # the shared forward failed: every row in it fails
            for sequence in batch.rows:
                self._fail(sequence, exc, events)
            return None
        results.verify_time = time.perf_counter() - batch.started
        return results

    def _queue_ahead(self, batch: StepBatch, outputs: list[RowOutput]) -> StepResults:
        """Queue the plain rows' next draws and the run-ahead drafting cycles' verdicts on
        this forward, without reading them (they are read in the next step)."""
        plain = batch.plain
        fed_ahead = [s in self.in_flight.plain for s in plain]
        drawn = queue_plain_rows(plain, outputs[: len(plain)], fed_ahead)
        queued = dict(zip(plain, drawn, strict=True))
        start = len(plain) + len(batch.drafting)
        ahead = outputs[start : start + len(batch.ahead)]
        rows = [(s, batch.drafts[s], o) for s, o in zip(batch.ahead, ahead, strict=True)]
        queued_drafts = {
            sequence: queue_draft(
                self.batched,
                sequence,
                draft,
                output,
                batch.plans[sequence].source,
                batch.started,
                verdict,
            )
            for (sequence, draft, output), verdict in zip(rows, verify_rows(rows), strict=True)
        }
        mx.async_eval(
            [(a.logits, a.hidden, a.sample) for a in queued.values()],
            [
                (q.output.hidden, q.num_accepted, q.output_tokens, q.num_rejected)
                for q in queued_drafts.values()
            ],
            self.batched.unevaluated() if queued_drafts else [],
        )
        return StepResults(queued, queued_drafts)
