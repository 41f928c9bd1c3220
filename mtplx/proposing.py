"""Proposing: the drafters' draft tokens for a step's drafting rows, before the forward.

Rows whose drafters share a ``batch_key`` propose together (one MTP head forward a depth for
all of them); each row's draws use its own stream's uniforms (``cycle_uniforms``), at the
position its next cycle starts from, also when the cycle before it is still computing (one
per possible verdict, picked lazily). Lookup drafts under a grammar carry the grammar's
masks. The cycle around the forward is ``mtplx.speculative``'s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from mtplx.arrays import scalar_int
from mtplx.cycle import Draft, QueuedDraft
from mtplx.drafters.base import DraftSampler
from mtplx.sequence import Sequence
from mtplx.speculative import cycle_uniforms, cycle_uniforms_np

__all__ = ["propose", "propose_rows"]


def propose(sequence: Sequence, num_draft: int, vocab_size: int) -> Draft:
    """Draft up to ``num_draft`` tokens for ``sequence`` (left lazy)."""
    draft = propose_rows([(sequence, num_draft)], vocab_size)[0]
    if isinstance(draft, Exception):
        raise draft
    return draft


def propose_rows(
    rows: list[tuple[Sequence, int]],
    vocab_size: int,
    queued: Mapping[Sequence, QueuedDraft] | None = None,
) -> list[Draft | Exception]:
    """``propose`` for many rows (sequence, number of drafts), left lazy: rows whose active
    drafters share a ``batch_key`` propose together (one MTP head forward a depth for all
    of them), each row's draft bitwise what it drafts alone. ``queued``: the rows' drafting
    cycles whose verdicts are still computing (a row's next cycle starts where its verdict
    ends). Per row its Draft, or the exception that failed it (a shared proposal that fails
    fails its rows)."""
    queued = queued or {}
    drafts: list[Draft | Exception | None] = [None] * len(rows)
    samplers: dict[int, DraftSampler] = {}
    uniforms: dict[int, mx.array] = {}
    groups: dict[object, list[int]] = {}
    for index, (sequence, num_draft) in enumerate(rows):
        try:
            uniforms[index] = _next_uniforms(sequence, num_draft, queued.get(sequence))
            drafter = sequence.drafter
            if drafter is None or num_draft <= 0:
                drafts[index] = Draft(mx.zeros((0,), mx.int32), [], uniforms[index], num_draft, 0.0)
                continue
            samplers[index] = DraftSampler(
                sequence.config,
                vocab_size,
                uniforms[index][:num_draft],
                sequence.token_counts,
                drafter.draft_vocab,
                sequence.grammar,
            )
            key = drafter.active().batch_key
            groups.setdefault(("alone", index) if key is None else key, []).append(index)
        except Exception as exc:
            drafts[index] = exc
    for members in groups.values():
        started = time.perf_counter()
        try:
            proposals = _propose_group(
                [rows[i][0] for i in members],
                [rows[i][1] for i in members],
                [samplers[i] for i in members],
            )
        except Exception as exc:
            for i in members:
                drafts[i] = exc
            continue
        seconds = time.perf_counter() - started
        for i, (tokens, qs) in zip(members, proposals, strict=True):
            try:
                drafts[i] = _draft(
                    rows[i][0], rows[i][1], tokens, qs, uniforms[i], samplers[i], seconds
                )
            except Exception as exc:
                drafts[i] = exc
    return [d for d in drafts if d is not None]


def _propose_group(
    sequences: list[Sequence], ks: list[int], samplers: list[DraftSampler]
) -> list[tuple[list[mx.array], list[mx.array]]]:
    """The proposals of rows whose active drafters propose together (one row: its own
    ``propose``)."""
    histories = [s.tokens for s in sequences]
    drafters = [s.drafter for s in sequences]
    assert all(d is not None for d in drafters)
    if len(sequences) == 1:
        assert drafters[0] is not None
        return [drafters[0].propose(histories[0], ks[0], samplers[0])]
    actives = [d.active() for d in drafters if d is not None]
    return actives[0].propose_batch(actives, histories, ks, samplers)


def _draft(
    sequence: Sequence,
    num_draft: int,
    tokens: list[mx.array],
    qs: list[mx.array],
    uniforms: mx.array,
    sampler: DraftSampler,
    seconds: float,
) -> Draft:
    """A row's Draft from its proposal; with a grammar, cut to the prefix it allows."""
    masks: list[mx.array] = []
    if sequence.grammar is not None and tokens:
        masks = sampler.masks if sampler.num_drawn else _lookup_masks(sequence, tokens)
        tokens, qs = tokens[: len(masks)], qs[: len(masks)]
    drafted = mx.stack(tokens).astype(mx.int32) if tokens else mx.zeros((0,), mx.int32)
    draft = Draft(drafted, qs, uniforms, num_draft, seconds)
    if sequence.grammar is not None and tokens:
        draft.masks = masks
    return draft


def _next_uniforms(sequence: Sequence, num_draft: int, queued: QueuedDraft | None) -> mx.array:
    """``cycle_uniforms`` of the row's next cycle; after a ``queued`` drafting cycle, whose
    verdict is lazy, those of each position it may end at, picked by its verdict. A greedy
    row reads none of them (its drafts and verdicts are argmaxes): zeros, without drawing
    the stream (two generators a cycle, a tenth of a millisecond each)."""
    if sequence.config.is_greedy:
        return _unread_uniforms(num_draft)
    if queued is None:
        return cycle_uniforms(sequence.seed, len(sequence.tokens), num_draft)
    candidates = np.stack(
        [
            cycle_uniforms_np(sequence.seed, len(sequence.tokens) + committed, num_draft)
            for committed in range(1, queued.draft.num_drafted + 2)
        ]
    )  # [k_queued + 1, 2 * num_draft + 1]
    return mx.take(mx.array(candidates), queued.num_accepted, axis=0)[0]


@functools.lru_cache(maxsize=16)
def _unread_uniforms(num_draft: int) -> mx.array:
    """[2k + 1] float32 zeros, evaluated: a greedy cycle's uniforms, which nothing reads."""
    zeros = mx.zeros((2 * num_draft + 1,), mx.float32)
    mx.eval(zeros)
    return zeros


def _lookup_masks(sequence: Sequence, tokens: list[mx.array]) -> list[mx.array]:
    """Proposals that never saw the grammar (n-gram lookup, one-hot q): advance the grammar
    through the longest prefix it allows and return the mask at each of those positions (a
    forbidden token ends the draft: its q would be masked to nothing)."""
    grammar = sequence.grammar
    assert grammar is not None
    masks = []
    for token in tokens:
        allowed = grammar.allowed()
        token_id = scalar_int(token)
        if allowed is None or not allowed[token_id]:
            break
        masks.append(mx.array(allowed))
        grammar.consume(token_id)
    return masks
