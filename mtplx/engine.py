"""The engine: owns a loaded model and all MLX work, on one thread, for a batch of sequences.

``add`` puts a request into the running batch; ``step`` advances every sequence by one
cycle with one batched target forward and returns the events it produced; ``abort`` drops
a sequence. One step (``step``):

    plan         per decoding row: draft source and depth (mtplx.planner)
    schedule     sort the rows: plain, drafting (verified now), drafting one step ahead;
                 a row whose in-flight cycle the plan cannot build on settles it first
                 (``_schedule`` -> ``StepBatch``, mtplx.step)
    run          the drafters propose; ONE target forward over every row's [last, d1..dk]
                 (or its queued token) and the prompt chunks that fit the step's token
                 budget; the exact rule (verify), lazily for the rows run ahead
                 (``_propose``, ``_inputs``, ``_execute`` -> ``StepResults``)
    postprocess  commit / roll back each verdict, account prompt chunks, put the queued
                 work in place (``_postprocess``)
    emit         per row: token events, stop rules, finish; finished rows leave the batch

Plain rows and MTP drafting rows run one step ahead: their forward is queued before the
previous one's result is read (``mtplx.speculative``), so building a step's graph overlaps
the previous step's compute.

``generate`` runs one request alone through the same step loop (batch size 1).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Iterator

import mlx.core as mx

from mtplx.arrays import scalar_int
from mtplx.cycle import CycleResult
from mtplx.drafter_registry import best_drafter
from mtplx.drafters.factories import drafter_factories
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.errors import InvalidParameter
from mtplx.events import prompt_logprobs, record_cycle, token_event
from mtplx.grammar import GrammarCompiler
from mtplx.models.base import LoadedModel, TargetModel
from mtplx.models.batched import BatchedTarget, RowOutput, batched_target
from mtplx.output import TextEmitter
from mtplx.planner import Plan, StepCosts, draft_source, make_policies, plan_cycle
from mtplx.prefix_cache import PrefixCache
from mtplx.prefix_reuse import PrefixReuse
from mtplx.request import FinishEvent, GenerationRequest, GenerationStats
from mtplx.sampling import mx_distribution_from_logits, mx_sample
from mtplx.sequence import Event, Sequence
from mtplx.speculative import (
    close_ahead,
    close_queued,
    commit,
    commits_lazily,
    cycle_uniforms,
    last_committed,
    plain_input,
    propose_rows,
    queue_draft,
    queue_plain_rows,
    verify,
)
from mtplx.step import StepBatch, StepResults

logger = logging.getLogger(__name__)

# Beside decoding streams, a step's tokens in all (decoding and prompt) stay within this many
# even where the target takes more rows a forward (``max_packed_rows``; a prompt alone then
# feeds more): the float32 invariant kernel's rows, which the streams' gaps were sized on.
BESIDE_STREAMS_TOKENS = 128
# Until calibration measures this machine: a plain step of B rows costs ~1 + B/8 of one
# row's, a verified token per row a third of a row's plain step.
DEFAULT_COSTS = StepCosts([1, 8, 16], [0.06, 0.12, 0.17], [0.02, 0.06, 0.1], [0.01, 0.01, 0.01])

StepEvent = tuple[Sequence, Event | BaseException]


class Engine:
    """Speculative generation over one loaded model for a batch of sequences. Not
    thread-safe: one thread uses it."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        default_drafter: str | None = None,
        default_depth: int | None = None,
        draft_model: TargetModel | None = None,
        max_adaptive_depth: int = 5,
        max_num_seqs: int = 16,
        prefill_chunk_size: int = 32,
        prefill_budget: int = 256,
        costs: StepCosts | None = None,
        prefix_cache_bytes: int = 0,
        max_kv_bytes: int | None = None,
        batched: BatchedTarget | None = None,
    ) -> None:
        self.model = model
        self.target = model.target
        # ``batched``: a batched form of the target built by the caller (a pipeline stage,
        # ``mtplx.distributed``); by default the fastest exact one for the model.
        self.batched = batched or batched_target(
            model.target, max_num_seqs, keep_hidden=prefix_cache_bytes > 0
        )
        self.prefix = PrefixReuse.build(
            prefix_cache_bytes, self.batched, prefill_chunk_size, model.path.name
        )
        self.tokenizer = model.tokenizer
        self.model_name = model.path.name
        self.context_length = model.context_length
        self.vocab_size = model.target.vocab_size
        self.max_adaptive_depth = max_adaptive_depth
        self.max_num_seqs = max_num_seqs
        # Admission on memory: no request starts while the running rows' KV holds this many
        # bytes or more (None: slots alone limit the batch). A request alone always starts.
        self.max_kv_bytes = max_kv_bytes
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_budget = max(prefill_budget, prefill_chunk_size)
        self.calibrated = costs is not None
        self._set_up_drafters(model, draft_model, default_drafter)
        self.costs = self._priced(costs or DEFAULT_COSTS)
        self.default_depth = default_depth
        self.eos_token_ids = set(model.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", set()) or set()
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        # A token whose text ends in a letter: fed to a detokenizer first (and its text
        # dropped), it makes the output's text continue the prompt's (``TextEmitter``).
        self._primer = self.tokenizer.encode("a", add_special_tokens=False)[-1]
        self.running: list[Sequence] = []
        self.num_rows_taken = 0  # rows handed out by ``add`` and not yet released
        self.num_steps = 0
        self.num_step_tokens = 0  # tokens committed by all steps, for /metrics
        # Calibration times proposing on its own (``time_drafts``): the last step's, all rows.
        self.time_drafts = False
        self.last_draft_seconds = 0.0

    def _set_up_drafters(
        self, model: LoadedModel, draft_model: TargetModel | None, default: str | None
    ) -> None:
        """The drafters this model offers, and the default one (None: the best it has)."""
        if draft_model is not None and draft_model.vocab_size != self.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({draft_model.vocab_size}) differs from the "
                f"target's ({self.vocab_size})"
            )
        self._drafters = drafter_factories(model, draft_model)
        self.available_drafters = tuple(self._drafters)
        if default is None:
            default = best_drafter(self.available_drafters)
        if default not in self._drafters:
            raise ValueError(
                f"drafter {default!r} is not available for {self.model_name}; "
                f"available: {', '.join(self.available_drafters)}"
            )
        self.default_drafter = default

    # -- requests -----------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidParameter naming the field before any work if ``request`` cannot run."""
        drafter = request.drafter or self.default_drafter
        if drafter not in self._drafters:
            raise InvalidParameter(
                "drafter",
                f"drafter {drafter!r} is not available for {self.model_name}; "
                f"available: {', '.join(self.available_drafters)}",
            )
        num_prompt = len(request.prompt_ids)
        if num_prompt >= self.context_length:
            raise InvalidParameter(
                "prompt_ids",
                f"prompt is {num_prompt} tokens, over the context length {self.context_length}",
                code="context_length_exceeded",
            )
        bad = [t for t in request.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InvalidParameter(
                "prompt_ids", f"prompt token ids {bad[:5]} are outside the vocabulary"
            )
        bad = [t for t in request.sampler.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidParameter(
                "logit_bias", f"logit_bias token ids {bad[:5]} are outside the vocabulary"
            )
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter(
                "stop_token_ids", f"stop_token_ids {bad[:5]} are outside the vocabulary"
            )

    def token_text(self, token_id: int) -> str:
        """Text of one token (for top logprobs)."""
        return self.tokenizer.decode([token_id])

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (None: off), for its counters."""
        return None if self.prefix is None else self.prefix.cache

    @property
    def has_room(self) -> bool:
        """Whether another sequence can join the batch now: a free slot, and the KV the
        running rows hold under ``max_kv_bytes``."""
        if len(self.running) >= self.max_num_seqs:
            return False
        return (
            not self.running
            or self.max_kv_bytes is None
            or self.batched.kv_nbytes < self.max_kv_bytes
        )

    def prepare(self, request: GenerationRequest) -> None:
        """The work of admitting ``request`` that need not hold up the batch: its grammar
        checked and compiled (cached for ``add``). Blocks; the server runs it on the grammar
        thread (``mtplx.grammar.grammar_thread``) before ``add``."""
        if request.grammar is not None:
            self.grammars.prepare(request.grammar, budget=request.close_within_budget)

    def add(self, request: GenerationRequest, tag: object = None) -> Sequence:
        """Put ``request`` into the running batch; its prompt is prefilled by the next
        steps. ``tag``: the caller's handle, kept on the sequence. Whatever fails leaves no
        row behind: the row is taken last, after everything that checks the request."""
        self.validate(request)
        if not self.has_room:
            raise RuntimeError(f"the batch is full ({self.max_num_seqs} sequences)")
        config = request.sampler
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.eos_token_ids
        budget = request.max_tokens if request.close_within_budget else None
        grammar = (
            None
            if request.grammar is None
            else self.grammars.state(request.grammar, stop_ids, budget)
        )
        drafter = self._drafters[request.drafter or self.default_drafter]()
        depth = request.depth if request.depth is not None else self.default_depth
        policies = {}
        if depth is None and drafter is not None:
            policies = make_policies(drafter, self.costs, self.max_adaptive_depth)
        prompt = [int(t) for t in request.prompt_ids]
        if drafter is not None:
            drafter.reset(prompt)
        primer = None if request.starts_reply else self._primer
        emitter = TextEmitter(self.tokenizer.detokenizer, request.stop, primer)
        token_counts = mx.zeros((self.vocab_size,), mx.int32) if config.has_penalties else None
        sequence = Sequence(
            request=request,
            tokens=list(prompt),
            num_prompt_tokens=len(prompt),
            row=self.batched.new_row(),
            seed=config.seed if config.seed is not None else secrets.randbits(63),
            drafter=drafter,
            policies=policies,
            depth=depth,
            emitter=emitter,
            stop_ids=stop_ids,
            stats=GenerationStats(prompt_tokens=len(prompt)),
            token_counts=token_counts,
            grammar=grammar,
            tag=tag,
        )
        self.running.append(sequence)
        self.num_rows_taken += 1
        if self.prefix is not None:
            try:
                self.prefix.reuse(sequence)
            except BaseException:
                self.abort(sequence)  # the caller fails the request: leave no row behind
                raise
        return sequence

    @property
    def num_orphan_rows(self) -> int:
        """Rows taken from the target that no running sequence holds (0 unless a path
        forgot to release one: such rows would keep every later request out)."""
        return self.num_rows_taken - len(self.running)

    def abort(self, sequence: Sequence) -> None:
        """Drop ``sequence`` from the batch (cancelled, failed or finished)."""
        sequence.finished = True
        sequence.ahead = None
        sequence.queued = None
        if sequence in self.running:
            self.running.remove(sequence)
            self.batched.release(sequence.row)
            self.num_rows_taken -= 1

    def generate(self, request: GenerationRequest) -> Iterator[Event]:
        """Yield a TokenEvent per committed token, then one FinishEvent: ``request`` alone
        through the step loop. Needs an empty batch; closing the generator cancels."""
        if self.running:
            raise RuntimeError("generate runs one request alone; the batch is not empty")
        sequence = self.add(request)
        try:
            while not sequence.finished:
                for _, event in self.step():
                    if isinstance(event, BaseException):
                        raise event
                    yield event
        finally:
            self.abort(sequence)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        """Advance every sequence of the batch by one cycle; the events it produced."""
        events: list[StepEvent] = []
        if not self.batched.max_packed_rows:
            self._prefill(events)  # one row per forward: prompts go in forwards of their own
        decoding = [s for s in self.running if s.prefilled and s.pending is None]
        # While a prompt is fed beside them, adaptive rows do not draft: the steps are long,
        # and a drafting row emits nothing in the step that re-queues its plain forward,
        # which would double its wait between tokens.
        prefilling = any(not s.prefilled for s in self.running)
        plans = {}
        for sequence in decoding:
            try:
                plans[sequence] = self._plan(sequence, len(decoding), prefilling)
            except Exception as exc:  # one row's failure fails that request alone
                self._fail(sequence, exc, events)
        self._run(plans, events)
        if not plans and self.batched.max_packed_rows:
            # Nothing decodes yet: more prompt chunks cost no stream a delay.
            fed = self.prefill_budget
            while (
                fed > 0
                and any(not s.prefilled and not s.finished for s in self.running)
                and not any(s.pending is not None for s in self.running)  # a first token waits
            ):
                before = sum(s.num_prefilled for s in self.running)
                self._run({}, events)
                fed -= sum(s.num_prefilled for s in self.running) - before
        for sequence in list(self.running):
            if sequence.pending is not None and not sequence.finished:
                events.extend((sequence, event) for event in self._emit(sequence))
        for sequence in [s for s in self.running if s.finished]:
            if self.prefix is not None and self.prefix.caches_replies and not sequence.failed:
                self.prefix.remember(sequence, sequence.row.length)  # the next turn holds it
            self.abort(sequence)
        self.num_steps += 1
        return events

    def _plan(self, sequence: Sequence, batch_size: int, prefilling: bool = False) -> Plan:
        """The row's next cycle (a plan waiting for its ahead to close goes first)."""
        if sequence.planned is not None:
            plan, sequence.planned = sequence.planned, None
            return plan
        if prefilling and sequence.policies:
            return Plan(None, 0)
        room = min(
            sequence.request.max_tokens - sequence.num_output_tokens,
            self.context_length - len(sequence.tokens),
        )
        if sequence.queued is not None:  # what its verdict may still commit (0: read it)
            room = max(room - sequence.queued.draft.num_drafted - 1, 1)
        return plan_cycle(
            sequence.drafter,
            sequence.policies,
            sequence.depth,
            sequence.tokens,
            room - 1,
            self.costs if self.calibrated else None,
            batch_size,
        )

    def _run(self, plans: dict[Sequence, Plan], events: list[StepEvent]) -> None:
        """One forward for the planned rows and the prompt chunks that ride along: the three
        phases of a step, with plain data between them."""
        batch = self._schedule(plans, events)
        self._propose(batch, events)
        inputs = self._inputs(batch)
        if not batch.rows:
            return
        results = self._execute(batch, inputs, events)
        if results is not None:
            self._postprocess(batch, results, events)

    # -- schedule: which rows decode, draft (now or one step ahead), which chunks ride along

    def _schedule(self, plans: dict[Sequence, Plan], events: list[StepEvent]) -> StepBatch:
        """Sort the planned rows by how this step runs them. A row with a cycle in flight
        that this plan cannot build on settles it first (reads its verdict or its draw) and
        feeds nothing this step."""
        batch = StepBatch(plans)
        for sequence, plan in plans.items():
            pipelined = plan.num_draft > 0 and self._pipelines(sequence, plan)
            if sequence.queued is not None and not pipelined:
                # Read the queued cycle's verdict; plan again from the history it completes.
                self._close_queued(sequence, events)
            elif plan.num_draft > 0 and sequence.ahead is not None:
                # Commit the queued forward's token first; draft after it next step.
                self._close_ahead(sequence, events)
                sequence.planned = plan
            elif plan.num_draft == 0 and not sequence.config.has_penalties and not sequence.grammar:
                # Not with a grammar either: the mask needs the previous token read first.
                batch.plain.append(sequence)
            elif pipelined:
                batch.ahead.append(sequence)
            else:
                batch.drafting.append(sequence)
        return batch

    def _inputs(self, batch: StepBatch) -> list[mx.array]:
        """Every row's tokens for the forward, in ``batch.rows`` order; schedules the prompt
        chunks into what the decoding rows leave of the step's token budget."""
        inputs = [plain_input(s) for s in batch.plain]
        for sequence in batch.drafting:
            draft = batch.drafts[sequence]
            if self.batched.recurrent and draft.num_drafted:
                draft.checkpoint = self.batched.checkpoint(sequence.row)
            inputs.append(draft.inputs(sequence.tokens[-1]))
        inputs += [batch.drafts[s].inputs(last_committed(s)) for s in batch.ahead]
        num_decode_tokens = sum(int(t.shape[0]) for t in inputs)
        batch.chunks = self._prefill_chunks(num_decode_tokens, idle=not batch.plans)
        return inputs + [mx.array(chunk, mx.int32) for _, chunk in batch.chunks]

    # -- run: the drafters, the one target forward, the acceptance rule ---------------------

    def _propose(self, batch: StepBatch, events: list[StepEvent]) -> None:
        """Every drafting row's drafter proposes (left lazy; evaluated ahead of the forward
        where that does not stall behind a queued cycle)."""
        draft_started = time.perf_counter()
        self.last_draft_seconds = 0.0
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
        for (sequence, _), draft in zip(rows, propose_rows(rows, self.vocab_size), strict=True):
            if isinstance(draft, Exception):
                for group in (batch.drafting, batch.ahead):
                    if sequence in group:
                        group.remove(sequence)
                self._fail(sequence, draft, events)
            else:
                batch.drafts[sequence] = draft
        if batch.drafts:
            proposals = [(d.tokens, d.qs) for d in batch.drafts.values()]
            if self.time_drafts:
                mx.eval(proposals)
                self.last_draft_seconds = time.perf_counter() - draft_started
            elif not any(s.queued is not None for s in batch.ahead):
                # The drafters compute while the forward's graph is built on top of them. Not
                # behind a queued cycle: MLX lets the host run only ~100 kernel dispatches
                # ahead, so evaluating now would wait for that cycle to all but finish.
                mx.async_eval(proposals)
        batch.started = time.perf_counter()

    def _execute(
        self, batch: StepBatch, inputs: list[mx.array], events: list[StepEvent]
    ) -> StepResults | None:
        """The batch's one forward; plain rows' draws and run-ahead cycles queued lazily,
        this step's verdicts evaluated. None: the forward failed, and every row in it."""
        wanted = ["all"] * batch.num_decoding + [
            _chunk_logits(s, len(chunk)) for s, chunk in batch.chunks
        ]
        try:
            outputs = self.batched.forward([s.row for s in batch.rows], inputs, wanted)
            results = self._queue_ahead(batch, outputs)
            decoded = outputs[len(batch.plain) : len(batch.plain) + len(batch.drafting)]
            if any(s.grammar is not None for s in batch.drafting):
                # Compute the forward while verify works out the grammar masks on the CPU.
                mx.async_eval([output.logits for output in decoded])
            for sequence, output in zip(batch.drafting, decoded, strict=True):
                verdict = verify(sequence, batch.drafts[sequence], output)
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
        queued = dict(zip(plain, queue_plain_rows(plain, outputs[: len(plain)]), strict=True))
        start = len(plain) + len(batch.drafting)
        queued_drafts = {
            sequence: queue_draft(
                self.batched,
                sequence,
                batch.drafts[sequence],
                output,
                batch.plans[sequence].source,
                batch.started,
            )
            for sequence, output in zip(
                batch.ahead, outputs[start : start + len(batch.ahead)], strict=True
            )
        }
        mx.async_eval(
            [(a.logits, a.hidden, a.sample) for a in queued.values()],
            [(q.output.hidden, q.num_accepted, q.output_tokens) for q in queued_drafts.values()],
            self.batched.unevaluated() if queued_drafts else [],
        )
        return StepResults(queued, queued_drafts)

    # -- postprocess: commit, roll back, hand on what runs ahead ---------------------------

    def _postprocess(self, batch: StepBatch, results: StepResults, events: list[StepEvent]) -> None:
        """Account the prompt chunks, commit this step's verdicts (rolling rows back past
        rejected drafts), and put the queued work in place, settling what it replaces."""
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
            sequence.pending = result
            record_cycle(sequence.stats, result)
        for sequence, plain_ahead in results.queued.items():
            if sequence.ahead is not None:
                self._close_ahead(sequence, events, batch.started)
            sequence.ahead = plain_ahead
        for sequence, queued_draft in results.queued_drafts.items():
            if sequence.queued is not None:
                self._close_queued(sequence, events)
            sequence.queued = queued_draft

    def _priced(self, costs: StepCosts) -> StepCosts:
        """``costs`` with the draft sources whose cycles run one step ahead here."""
        ahead = []
        if self.batched.trims_lazily:
            for name, factory in self._drafters.items():
                drafter = factory() if "+" not in name else None  # one of each drafter
                if drafter is not None and drafter.commits_lazily:
                    ahead.append(name)
        return dataclasses.replace(costs, ahead=tuple(ahead))

    def _pipelines(self, sequence: Sequence, plan: Plan) -> bool:
        """Whether the row's drafting cycle of ``plan`` runs one step ahead: from a model
        drafter that takes lazy commits, over a target that trims lazily (not while
        calibration times proposing alone: behind a queued cycle it would time that too)."""
        drafter = sequence.drafter
        return (
            not self.time_drafts
            and self.batched.trims_lazily
            and commits_lazily(sequence)
            and drafter is not None
            and plan.source != LOOKUP
            and plan.source in drafter.sources
        )

    def _close_queued(self, sequence: Sequence, events: list[StepEvent]) -> None:
        """Commit the verdict of the row's queued drafting cycle (``close_queued``)."""
        queued, sequence.queued = sequence.queued, None
        assert queued is not None
        try:
            result = close_queued(self.batched, sequence, queued)
        except Exception as exc:
            self._fail(sequence, exc, events)
            return
        if queued.source in sequence.policies:
            sequence.policies[queued.source].update(result.num_drafted, result.num_accepted)
        sequence.pending = result
        record_cycle(sequence.stats, result)

    def _close_ahead(
        self, sequence: Sequence, events: list[StepEvent], started: float | None = None
    ) -> None:
        """Commit the draw of the row's queued forward (``close_ahead``)."""
        ahead, sequence.ahead = sequence.ahead, None
        assert ahead is not None
        try:
            sequence.pending = close_ahead(sequence.drafter, ahead, started)
        except Exception as exc:
            self._fail(sequence, exc, events)
            return
        record_cycle(sequence.stats, sequence.pending)

    def _prefill_chunks(
        self, num_decode_tokens: int, idle: bool = False
    ) -> list[tuple[Sequence, list[int]]]:
        """Prompt tokens to feed in this step's forward beside ``num_decode_tokens``
        decoding ones, all within ``max_packed_rows`` (every row then stays batch-invariant)
        and, beside decoding streams, within BESIDE_STREAMS_TOKENS (a stream's gap between
        tokens grows with the step): waiting prompts share what is left, oldest first, each
        at most ``_prefill_piece``;
        at least one token a step while any prompt waits. ``idle``: no stream decodes."""
        rows = self.batched.max_packed_rows
        if idle:  # nothing decodes, nobody waits on the step: a whole forward of prompt
            budget = min(max(self.prefill_budget, self.batched.max_prefill_tokens), rows)
        else:  # a running stream waits for the step: its tokens in all stay few
            budget = min(self.prefill_budget, min(rows, BESIDE_STREAMS_TOKENS) - num_decode_tokens)
        waiting = [s for s in self.running if not s.prefilled and not s.finished]
        if self.prefix is not None:
            for sequence in waiting:
                self.prefix.reuse(sequence)  # blocks other prompts have fed since
            waiting = [s for i, s in enumerate(waiting) if not self.prefix.fed_by(s, waiting[:i])]
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

    def _prefilled_chunk(
        self, sequence: Sequence, size: int, output: RowOutput, seconds: float
    ) -> None:
        """A prompt chunk went through the step's forward: keep the hidden states the
        drafter reads; after the last chunk, sample the first token."""
        drafter = sequence.drafter
        if drafter is not None and drafter.needs_hidden:
            sequence.prefill_hidden.append(output.hidden)
        output = self._scored(sequence, output)
        sequence.num_prefilled += size
        sequence.stats.prefill_time += seconds
        if self.prefix is not None:
            self.prefix.remember(sequence, sequence.num_prefilled)
            if sequence.prefilled:  # counted now: blocks fed beside it may be copied late
                self.prefix.cache.record_lookup(sequence.stats.cached_tokens)
        if sequence.prefilled:
            self._first_token(sequence, output)

    def _prefill(self, events: list[StepEvent]) -> None:
        """Feed admitted prompts in chunks of ``prefill_chunk_size`` (fixed by the prompt
        alone, so a prompt's cache is bitwise the same in any batch), a chunk per waiting
        prompt in turn, oldest first (a short prompt behind a long one starts at once),
        until this step's ``prefill_budget`` tokens are spent (at least one chunk a step)."""
        budget = self.prefill_budget
        while budget > 0:
            waiting = [s for s in self.running if not s.prefilled and not s.finished]
            if self.prefix is not None:
                for sequence in waiting:
                    self.prefix.reuse(sequence)  # blocks other prompts have fed since
                waiting = [
                    s for i, s in enumerate(waiting) if not self.prefix.fed_by(s, waiting[:i])
                ]
            if not waiting:
                return
            for sequence in waiting:
                start = sequence.num_prefilled
                chunk = sequence.tokens[start : start + self.prefill_chunk_size]
                if len(chunk) > budget and budget < self.prefill_budget:
                    return
                budget -= len(chunk)
                try:
                    self._prefill_chunk(sequence, chunk)
                except Exception as exc:
                    self._fail(sequence, exc, events)

    def _prefill_chunk(self, sequence: Sequence, chunk: list[int]) -> None:
        """One prompt chunk through the target; after the last, sample the first token."""
        started = time.perf_counter()
        last = sequence.num_prefilled + len(chunk) >= sequence.num_prompt_tokens
        tokens = mx.array(chunk, mx.int32)
        wanted = _chunk_logits(sequence, len(chunk))
        output = self.batched.forward([sequence.row], [tokens], wanted)[0]
        drafter = sequence.drafter
        if drafter is not None and drafter.needs_hidden:
            sequence.prefill_hidden.append(output.hidden)
        mx.eval(output.hidden if output.logits is None else output.logits, sequence.prefill_hidden)
        output = self._scored(sequence, output)
        start = sequence.num_prefilled
        sequence.num_prefilled += len(chunk)
        if self.prefix is not None:
            self.prefix.remember(sequence, sequence.num_prefilled, (start, output.hidden))
            if last:
                self.prefix.cache.record_lookup(sequence.stats.cached_tokens)
        if last:
            self._first_token(sequence, output)
        sequence.stats.prefill_time += time.perf_counter() - started

    def _scored(self, sequence: Sequence, output: RowOutput) -> RowOutput:
        """Score a prompt chunk that fed with every position's logits (``prompt_logprobs``);
        the chunk's output with its last position's logits only, as an unscored one has."""
        num_top = sequence.request.prompt_logprobs
        if num_top is None or output.logits is None:
            return output
        sequence.prompt_logprobs += prompt_logprobs(
            output.logits,
            sequence.tokens[: sequence.num_prompt_tokens],
            sequence.num_prefilled,
            num_top,
        )
        return RowOutput(output.logits[-1:], output.hidden)

    def _first_token(self, sequence: Sequence, output: RowOutput) -> None:
        """Sample the token after the prompt and bring the drafter up to date (nothing to
        sample when the request only scores its prompt: ``max_tokens`` 0)."""
        if sequence.request.max_tokens == 0:
            sequence.pending = CycleResult([], 0, 0, output.asked_logits(), 0.0, 0.0)
            return
        counts = None if sequence.token_counts is None else sequence.token_counts[None]
        grammar, mask = sequence.grammar, None
        if grammar is not None:
            allowed = grammar.allowed()
            mask = None if allowed is None else mx.array(allowed)[None]
        logits = output.asked_logits()
        probs = mx_distribution_from_logits(logits, sequence.config, counts, mask)
        uniform = cycle_uniforms(sequence.seed, sequence.num_prompt_tokens, 0)
        token = scalar_int(mx_sample(probs, uniform))
        committed = [token]
        if grammar is not None:
            if grammar.finished:  # a grammar that allows only the empty text
                committed = []
            else:
                grammar.consume(token)
        drafter = sequence.drafter
        if drafter is not None:
            hidden = None
            if drafter.needs_hidden:
                hidden = mx.concatenate(sequence.prefill_hidden, axis=0)[None]
            drafter.commit([*sequence.tokens[1:], token], hidden)
        sequence.prefill_hidden = []
        sequence.pending = CycleResult(committed, 0, 0, logits, 0.0, 0.0)

    def _emit(self, sequence: Sequence) -> list[Event]:
        """Turn the row's committed tokens into events; finish it on a stop condition."""
        result, sequence.pending = sequence.pending, None
        assert result is not None
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
        sequence.finished = True
        scored = None
        if sequence.request.prompt_logprobs is not None:
            scored = tuple(sequence.prompt_logprobs)
        return FinishEvent(reason, sequence.stats, text, stop_sequence, scored)  # type: ignore[arg-type]

    def _fail(self, sequence: Sequence, exc: BaseException, events: list[StepEvent]) -> None:
        """Fail one request: it leaves the batch with its exception as its last event."""
        logger.exception("generation failed", exc_info=exc)
        sequence.finished = True
        sequence.failed = True
        sequence.pending = None
        events.append((sequence, exc))

    # -- cost calibration ---------------------------------------------------------------

    def warm_up(self) -> None:
        """Measure (or load) the step cost model the adaptive depth policy prices depths
        with, before the first request (``mtplx.calibration``)."""
        from mtplx.calibration import load_or_calibrate

        self.costs = self._priced(load_or_calibrate(self))
        self.calibrated = True
        if self.prefix is not None:
            self.prefix.restart()  # calibration's own prompts: blocks and counts
        try:
            self.grammars.warm()
        except Exception:  # a tokenizer llguidance cannot read: constrained requests fail alone
            logger.warning("constrained decoding is unavailable for this tokenizer", exc_info=True)


def _chunk_logits(sequence: Sequence, size: int) -> str:
    """The logits a prompt chunk's forward asks for: every position's when the request
    scores its prompt, else the last position's after the prompt's last chunk only."""
    if sequence.request.prompt_logprobs is not None:
        return "all"
    return "last" if sequence.num_prefilled + size >= sequence.num_prompt_tokens else "none"
