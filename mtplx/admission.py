"""Requests in and out of the running batch: checks, the row and everything a sequence
owns (``add``), room for another (slots, KV memory: what the running rows hold, what the
prompts admitted will take, and the request's own prompt), and leaving (``abort``)."""

from __future__ import annotations

import secrets

import mlx.core as mx

from mtplx.engine_state import EngineState
from mtplx.errors import InvalidParameter
from mtplx.output import TextEmitter
from mtplx.planner import make_policies, sampling_kind
from mtplx.request import GenerationRequest, GenerationStats
from mtplx.sequence import Sequence, Status

__all__ = ["Admission"]


class Admission(EngineState):
    """Admitting requests into the batch and dropping them from it."""

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
        self._validate_kv(num_prompt)

    def _validate_kv(self, num_prompt: int) -> None:
        """Raise InvalidParameter when a prompt of ``num_prompt`` tokens would take more KV
        than ``max_kv_bytes`` alone: it could never be admitted beside anything, and alone
        it would pass the bound the server was given (a target that cannot say what a
        prompt takes admits it alone)."""
        needed = self.prompt_kv_bytes(num_prompt)
        if self.max_kv_bytes is None or needed is None or needed <= self.max_kv_bytes:
            return
        per_position = self.prompt_kv_bytes(1) or 1
        raise InvalidParameter(
            "prompt_ids",
            f"prompt is {num_prompt} tokens, whose KV ({needed} bytes) is over this server's "
            f"max_kv_bytes ({self.max_kv_bytes}): at most "
            f"{self.max_kv_bytes // per_position} prompt tokens fit",
            code="context_length_exceeded",
        )

    def prompt_kv_bytes(self, num_tokens: int) -> int | None:
        """Bytes of KV a row takes for ``num_tokens`` prompt positions (None: the target
        cannot say before it has saved a block). Pure arithmetic: safe off the engine
        thread."""
        return self.batched.block_nbytes(num_tokens)

    @property
    def has_room(self) -> bool:
        """Whether some sequence could join the batch now: a free slot, and the KV the
        running rows hold, plus what the prompts admitted since the last forward will take,
        under ``max_kv_bytes`` (``has_room_for`` also counts a request's own prompt)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        left = self._kv_bytes_left()
        return left is None or left > 0

    def has_room_for(self, request: GenerationRequest) -> bool:
        """Whether ``request`` can join the batch now: a free slot, and the KV its prompt
        will take fits within ``max_kv_bytes`` beside what the running rows hold and what
        the prompts admitted since the last forward will take (``kv_bytes_due``). A request
        alone always starts (``validate`` refuses a prompt whose KV alone is over the
        bound). The bound is checked at admission: replies grow the KV past it as they
        decode, as a vLLM server's running requests do."""
        if len(self.running) >= self.max_num_seqs:
            return False
        left = self._kv_bytes_left()
        if left is None:
            return True
        own = self.prompt_kv_bytes(len(request.prompt_ids))
        if own is None:  # the target cannot say: the KV held under the bound suffices
            return left > 0
        return own <= left

    def _kv_bytes_left(self) -> int | None:
        """What ``max_kv_bytes`` leaves beside the KV the running rows hold and will take
        (``kv_bytes_due``); negative when they are past it. None: nothing binds (no bound,
        or no row runs)."""
        if not self.running or self.max_kv_bytes is None:
            return None
        return self.max_kv_bytes - self.batched.kv_nbytes - self.kv_bytes_due

    @property
    def kv_nbytes(self) -> int:
        """Bytes of KV (and kept hidden states) the target's stores hold now: the running
        rows' and the idle store's (the KV gauge of /health and /metrics)."""
        return self.batched.kv_nbytes

    @property
    def kv_bytes_due(self) -> int:
        """KV the running sequences with no prompt token in their row yet will take at
        their first forward (their prompts'; 0 where the target cannot say): rows take
        their memory there, so without it a burst of long prompts would all be admitted
        before any is counted. A first chunk still in flight is counted twice for that
        step (its row's memory is taken, ``num_prefilled`` not yet moved): it errs toward
        waiting."""
        per_position = self.prompt_kv_bytes(1)
        if not per_position:
            return 0
        return per_position * sum(
            sequence.num_prompt_tokens for sequence in self.running if not sequence.num_prefilled
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
        if len(self.running) >= self.max_num_seqs:
            raise RuntimeError(f"the batch is full ({self.max_num_seqs} sequences)")
        if not self.has_room_for(request):
            raise RuntimeError(f"the batch's KV is at its bound ({self.max_kv_bytes} bytes)")
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
            # priced by the row's own kind: a sampled verdict costs more than a greedy one
            kind = sampling_kind(config)
            policies = make_policies(drafter, self.costs, self.max_adaptive_depth, kind)
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
            row=self.batched.new_row(len(prompt)),
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
        """Drop ``sequence`` from the batch (cancelled, failed or finished), and its work in
        flight."""
        if not sequence.finished:
            sequence.status = Status.FINISHED
        self.in_flight.drop(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
            self.batched.release(sequence.row)
            self.num_rows_taken -= 1
