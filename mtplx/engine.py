"""The engine: owns a loaded model and all MLX work, on one thread, for a batch of sequences.

``add`` puts a request into the running batch; ``step`` advances every sequence by one
cycle with one batched target forward and returns the events it produced; ``abort`` drops
a sequence. One step (``step``, ``_run``), each phase in its module:

    plan         per decoding row: draft source and depth (``Schedule._plan``,
                 mtplx.planner)
    schedule     sort the rows: plain, drafting (verified now), drafting one step ahead;
                 a row whose in-flight cycle the plan cannot build on settles it first
                 (``Schedule._schedule`` -> ``StepBatch``, mtplx.schedule, mtplx.step)
    run          the drafters propose, one proposal per draft source for all its rows (one
                 MTP head forward a depth); ONE target forward over every row's
                 [last, d1..dk] (or its queued token) and the prompt chunks that fit the
                 step's token budget; the exact rule (verify), lazily for the rows run ahead
                 (mtplx.runner -> ``StepResults``)
    postprocess  commit / roll back each verdict, account prompt chunks, put the queued
                 work in flight (mtplx.postprocess, mtplx.prefill)
    emit         per row: token events, stop rules, finish; finished rows leave the batch

A sequence has one status (prefilling, running, finished, failed: ``mtplx.sequence``).
Plain rows and MTP drafting rows run one step ahead: their forward is queued before the
previous one's result is read (``mtplx.speculative``), so building a step's graph overlaps
the previous step's compute. That queued work belongs to the batch, not to its rows: the
engine's ``in_flight`` record (``mtplx.step.InFlight``), which the run's results fill and
the next step's schedule and postprocess settle. Requests come and go through
``mtplx.admission``; the state every phase shares is declared in ``mtplx.engine_state``.

``generate`` runs one request alone through the same step loop (batch size 1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import mlx.core as mx

from mtplx.admission import Admission
from mtplx.drafter_registry import best_drafter
from mtplx.drafters.factories import drafter_factories
from mtplx.engine_state import StepEvent
from mtplx.grammar import GrammarCompiler
from mtplx.models.base import LoadedModel, TargetModel
from mtplx.models.batched import batched_target
from mtplx.models.rows import BatchedTarget
from mtplx.planner import Plan, StepCosts
from mtplx.postprocess import Postprocess
from mtplx.prefill_cost import keys_per_token
from mtplx.prefix_cache import PrefixCache
from mtplx.prefix_reuse import PrefixReuse
from mtplx.request import GenerationRequest
from mtplx.runner import Runner
from mtplx.schedule import Schedule
from mtplx.sequence import Event, Sequence, Status
from mtplx.step import InFlight

__all__ = ["DEFAULT_COSTS", "Engine", "StepEvent"]

logger = logging.getLogger(__name__)

# Until calibration measures this machine: a plain step of B rows costs ~1 + B/8 of one
# row's, a verified token per row a third of a row's plain step.
DEFAULT_COSTS = StepCosts([1, 8, 16], [0.06, 0.12, 0.17], [0.02, 0.06, 0.1], [0.01, 0.01, 0.01])


class Engine(Admission, Schedule, Runner, Postprocess):
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
        # Admission on memory: a request starts when its prompt's KV fits within this many
        # bytes beside what the running rows hold and will take (None: slots alone limit
        # the batch). A request alone always starts; a prompt whose KV alone is over it is
        # refused (``Admission.has_room_for``, ``Admission.validate``).
        self.max_kv_bytes = max_kv_bytes
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_budget = max(prefill_budget, prefill_chunk_size)
        self.keys_per_token = keys_per_token(model.config)  # prompts' cost: mtplx.prefill_cost
        self.calibrated = costs is not None
        self._set_up_drafters(model, draft_model, default_drafter)
        self.costs = self.priced(costs or DEFAULT_COSTS)
        self.default_depth = default_depth
        self.eos_token_ids = set(model.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", set()) or set()
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        # A token whose text ends in a letter: fed to a detokenizer first (and its text
        # dropped), it makes the output's text continue the prompt's (``TextEmitter``).
        self._primer = self.tokenizer.encode("a", add_special_tokens=False)[-1]
        self.running: list[Sequence] = []
        self.in_flight = InFlight()  # the batch's work one step ahead
        self.num_rows_taken = 0  # rows handed out by ``add`` and not yet released
        self.num_steps = 0
        self.num_step_tokens = 0  # tokens committed by all steps, for /metrics

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

    # -- requests (admission: mtplx.admission) ---------------------------------------------

    def token_text(self, token_id: int) -> str:
        """Text of one token (for top logprobs)."""
        return self.tokenizer.decode([token_id])

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (None: off), for its counters."""
        return None if self.prefix is None else self.prefix.cache

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

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        """Advance every sequence of the batch by one cycle; the events it produced."""
        events: list[StepEvent] = []
        plans = self._plans(events)  # plan: each decoding row's next cycle
        self._run(plans, events)  # schedule -> run -> postprocess: one target forward
        if not plans:
            self._feed_prompts(events)  # nothing decodes yet: more prompt chunks
        self._emit_committed(events)  # emit
        self._retire()
        self.num_steps += 1
        return events

    def _run(self, plans: dict[Sequence, Plan], events: list[StepEvent]) -> None:
        """One forward for the planned rows and the prompt chunks that ride along: the three
        phases of a step, with plain data between them."""
        batch = self._schedule(plans, events)  # schedule
        self._propose(batch, events)  # run: the drafters
        inputs = self._inputs(batch)
        batch.chunks = self._prefill_chunks(sum(int(t.shape[0]) for t in inputs), not plans)
        inputs += [mx.array(chunk, mx.int32) for _, chunk in batch.chunks]
        if not batch.rows:
            return
        results = self._execute(batch, inputs, events)  # run: the forward, the verdicts
        if results is not None:
            self._postprocess(batch, results, events)  # postprocess

    def _feed_prompts(self, events: list[StepEvent]) -> None:
        """While no stream decodes, forwards of prompt chunks alone up to the step's
        prefill budget (they delay nobody), until a first token waits to be emitted."""
        fed = self.prefill_budget
        while (
            fed > 0
            and any(s.status is Status.PREFILLING for s in self.running)
            and not self.in_flight.committed  # a first token waits to be emitted
        ):
            before = sum(s.num_prefilled for s in self.running)
            self._run({}, events)
            fed -= sum(s.num_prefilled for s in self.running) - before

    def _retire(self) -> None:
        """Finished rows leave the batch (a finished reply's blocks cached first, where the
        prefix cache keeps replies: the next turn of the chat holds it)."""
        for sequence in [s for s in self.running if s.finished]:
            if self.prefix is not None and self.prefix.caches_replies and not sequence.failed:
                self.prefix.remember(sequence, sequence.row.length)
            self.abort(sequence)

    # -- cost calibration ---------------------------------------------------------------

    def warm_up(self) -> None:
        """Measure (or load) the step cost model the adaptive depth policy prices depths
        with, before the first request (``mtplx.calibration``)."""
        from mtplx.calibration import load_or_calibrate

        self.costs = self.priced(load_or_calibrate(self))
        self.calibrated = True
        if self.prefix is not None:
            self.prefix.restart()  # calibration's own prompts: blocks and counts
        try:
            self.grammars.warm()
        except Exception:  # a tokenizer llguidance cannot read: constrained requests fail alone
            logger.warning("constrained decoding is unavailable for this tokenizer", exc_info=True)
