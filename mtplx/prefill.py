"""Prompts into the target: the chunks of a prompt whose target's states depend on how it is
split into forwards (``fixed_chunks``), the accounting of a prompt chunk that rode along in a
step's forward, prompt scoring, and the first token sampled after the prompt."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mtplx.arrays import scalar_int
from mtplx.cycle import CycleResult
from mtplx.engine_state import EngineState
from mtplx.events import prompt_logprobs
from mtplx.models.rows import RowOutput
from mtplx.sampling.fast_path import sample_logits
from mtplx.sequence import Sequence, Status
from mtplx.speculative import cycle_uniforms

__all__ = ["Prefill", "chunk_logits", "fixed_chunks"]


class Prefill(EngineState):
    """Feeding prompts and starting the reply."""

    def _prefilled_chunk(
        self, sequence: Sequence, size: int, output: RowOutput, seconds: float
    ) -> None:
        """A prompt chunk went through the step's forward: keep the hidden states the
        drafter reads; after the last chunk, sample the first token."""
        drafter = sequence.drafter
        if drafter is not None and drafter.needs_hidden:
            sequence.prefill_hidden.append(output.hidden)
        output = self._scored(sequence, output)
        start = sequence.num_prefilled
        sequence.num_prefilled += size
        sequence.stats.prefill_time += seconds
        last = sequence.num_prefilled >= sequence.num_prompt_tokens
        if self.prefix is not None:
            # The chunk's hidden states: what a target that keeps none saves in a block.
            self.prefix.remember(sequence, sequence.num_prefilled, (start, output.hidden))
            if last:  # counted now: blocks fed beside it may be copied late
                self.prefix.cache.record_lookup(sequence.stats.cached_tokens)
        if last:
            self._first_token(sequence, output)

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
        sample when the request only scores its prompt: ``max_tokens`` 0); the sequence
        runs from here."""
        sequence.status = Status.RUNNING
        if sequence.request.max_tokens == 0:
            self.in_flight.committed[sequence] = CycleResult(
                [], 0, 0, output.asked_logits(), 0.0, 0.0
            )
            return
        counts = None if sequence.token_counts is None else sequence.token_counts[None]
        grammar, mask = sequence.grammar, None
        if grammar is not None:
            allowed = grammar.allowed()
            mask = None if allowed is None else mx.array(allowed)[None]
        logits = output.asked_logits()
        uniform = cycle_uniforms(sequence.seed, sequence.num_prompt_tokens, 0)
        token = scalar_int(sample_logits(logits, sequence.config, uniform, counts, mask))
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
        self.in_flight.committed[sequence] = CycleResult(committed, 0, 0, logits, 0.0, 0.0)


def chunk_logits(sequence: Sequence, size: int) -> str:
    """The logits a prompt chunk's forward asks for: every position's when the request
    scores its prompt, else the last position's after the prompt's last chunk only."""
    if sequence.request.prompt_logprobs is not None:
        return "all"
    return "last" if sequence.num_prefilled + size >= sequence.num_prompt_tokens else "none"


def fixed_chunks(
    waiting: list[Sequence],
    budget: int,
    chunk_size: int,
    cost: Callable[[Sequence, int], int] | None = None,
) -> list[tuple[Sequence, list[int]]]:
    """The prompt chunks of a step for a target whose states depend on how a prompt is split
    into forwards (not ``resumes_anywhere``: one forward per row): each waiting prompt's
    next chunk of ``chunk_size`` tokens, fixed by the prompt alone (so its states are
    bitwise the same in any batch, and cached blocks resume at chunk ends), in ``waiting``'s
    order, those that fit in ``budget`` (the first one always): tokens, or what
    ``cost(sequence, size)`` prices a chunk of ``size`` tokens at."""
    chunks: list[tuple[Sequence, list[int]]] = []
    for sequence in waiting:
        start = sequence.num_prefilled
        chunk = sequence.tokens[start : min(start + chunk_size, sequence.num_prompt_tokens)]
        price = len(chunk) if cost is None else cost(sequence, len(chunk))
        if chunks and price > budget:
            continue  # a shorter or shallower prompt's chunk behind it may still fit
        chunks.append((sequence, chunk))
        budget -= price
    return chunks
