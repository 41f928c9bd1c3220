"""The postprocess of a step: prompt chunks accounted, verdicts committed (rows rolled
back past rejected drafts), the queued work put in the batch's in-flight record, then each
row's committed tokens turned into events, stop rules applied and finished rows marked."""

from __future__ import annotations

import mlx.core as mx

from mtplx.cycle import CycleResult
from mtplx.engine_state import StepEvent
from mtplx.events import record_cycle, token_event
from mtplx.prefill import Prefill
from mtplx.request import FinishEvent
from mtplx.sequence import Event, Sequence, Status
from mtplx.speculative import commit
from mtplx.step import StepBatch, StepResults

__all__ = ["Postprocess"]


class Postprocess(Prefill):
    """Committing a step's results and emitting their events."""

    def _postprocess(self, batch: StepBatch, results: StepResults, events: list[StepEvent]) -> None:
        """Account the prompt chunks, commit this step's verdicts (rolling rows back past
        rejected drafts), and put the queued work in flight, settling what it replaces."""
        for (sequence, chunk), output in zip(batch.chunks, results.prefilled, strict=True):
            try:
                self._prefilled_chunk(sequence, len(chunk), output, results.verify_time)
            except Exception as exc:
                self._fail(sequence, exc, events)
        for sequence, (output, accepted, tokens) in results.verdicts.items():
            try:
                result = commit(
                    self.batched,
                    sequence,
                    batch.drafts[sequence],
                    output,
                    accepted,
                    tokens,
                    results.verify_time,
                )
            except Exception as exc:
                self._fail(sequence, exc, events)
                continue
            plan = batch.plans[sequence]
            if plan.source in sequence.policies and plan.num_draft > 0:
                sequence.policies[plan.source].update(result.num_drafted, result.num_accepted)
            self.in_flight.committed[sequence] = result
            record_cycle(sequence.stats, result)
        in_flight = self.in_flight
        for sequence, plain_ahead in results.queued.items():
            if sequence in in_flight.plain:
                self._close_ahead(sequence, events, batch.started)
            in_flight.plain[sequence] = plain_ahead
        for sequence, queued_draft in results.queued_drafts.items():
            if sequence in in_flight.drafts:
                self._close_queued(sequence, events)
            in_flight.drafts[sequence] = queued_draft

    def _emit_committed(self, events: list[StepEvent]) -> None:
        """Emit what each running row committed this step, in batch order."""
        committed, self.in_flight.committed = self.in_flight.committed, {}
        for sequence in list(self.running):
            result = committed.get(sequence)
            if result is not None and not sequence.finished:
                events.extend((sequence, event) for event in self._emit(sequence, result))

    def _emit(self, sequence: Sequence, result: CycleResult) -> list[Event]:
        """Turn the row's committed tokens into events; finish it on a stop condition."""
        request, stats, emitter = sequence.request, sequence.stats, sequence.emitter
        events: list[Event] = []
        if request.max_tokens == 0:
            return [self._finish(sequence, "length")]
        for index, token in enumerate(result.committed):
            sequence.tokens.append(token)
            self.num_step_tokens += 1
            if token in sequence.stop_ids:
                return [*events, self._finish(sequence, "stop", emitter.flush())]
            stats.completion_tokens += 1
            text = emitter.add(token)
            events.append(token_event(result, index, token, text, request.logprobs))
            if emitter.stopped:
                return [*events, self._finish(sequence, "stop", stop_sequence=emitter.matched)]
            if sequence.num_output_tokens >= request.max_tokens:
                return [*events, self._finish(sequence, "length", emitter.flush())]
        if sequence.grammar is not None and sequence.grammar.finished:
            # Complete with no continuation: plain decoding would stop here with certainty.
            return [*events, self._finish(sequence, "stop", emitter.flush())]
        if sequence.token_counts is not None and result.committed:
            committed = mx.array(result.committed, mx.int32)
            sequence.token_counts = sequence.token_counts.at[committed].add(1)
        if len(sequence.tokens) >= self.context_length:
            return [*events, self._finish(sequence, "length", emitter.flush())]
        return events

    def _finish(
        self, sequence: Sequence, reason: str, text: str = "", stop_sequence: str | None = None
    ) -> FinishEvent:
        sequence.status = Status.FINISHED
        scored = None
        if sequence.request.prompt_logprobs is not None:
            scored = tuple(sequence.prompt_logprobs)
        return FinishEvent(reason, sequence.stats, text, stop_sequence, scored)  # type: ignore[arg-type]
