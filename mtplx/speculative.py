"""The draft / verify / accept / commit cycle of one row, around the batch's shared forward.

A cycle with no draft tokens is plain decoding: the target forward over the newest committed
token alone, then a sample from p. With k draft tokens the row feeds ``[last, d1 .. dk]``
to the step's one batched target forward; the exact rule of ``mtplx.sampling`` accepts a
prefix and emits the recovered or bonus token, and the row is rolled back past the rejected
drafts. The engine calls, per step: ``propose_rows`` (``mtplx.proposing``, before the forward;
the rows whose drafters share a ``batch_key`` propose together, e.g. one MTP head forward a
depth for all of them), ``verify_rows`` (after it, lazily; a greedy row's verdict one kernel
node, or without the kernel the greedy rows' rule once over their flattened positions), then
``commit`` per row once the step's results are evaluated.

Plain cycles run one step ahead, as mlx-lm's generate loop does: the forward of the token
being committed is queued (``queue_plain``: the next token's draw from it stays lazy) before
that token is read, so building the next graph in Python overlaps the current compute. The
queued forward (an ``Ahead``) then serves the next step: a plain row feeds its lazy draw to
the next forward and commits it (``close_ahead``); before a drafting cycle the row only
closes it, and the drafting cycle verifies from the position after it. (Verifying the
drafts against the queued forward's logits instead would spend that forward's token.)

Drafting cycles from the MTP head run one step ahead too (``queue_draft``): the verdict stays
lazy, the row is trimmed by a count still computing (``trim_lazily``) and the head gets the
cycle's pairs with the count that holds (``commit_lazy``). The next cycle is built on top:
its first input is the lazy last committed token, its uniforms the stream's at the lazily
chosen position (``cycle_uniforms`` of each possible one, picked by the verdict), so it
draws exactly what the cycle built after reading the verdict would. Then the verdict is read
(``close_queued``) while the new cycle computes.

The in-flight data these functions pass between steps (``CycleResult``, ``Ahead``,
``Draft``, ``QueuedDraft``) is ``mtplx.cycle``'s; the engine keeps what is queued one step
ahead for the whole batch (``mtplx.step.InFlight``) and passes a row's to these functions.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mtplx import fused_layer
from mtplx.arrays import int_rows, scalar_int
from mtplx.cycle import Ahead, CycleResult, Draft, QueuedDraft
from mtplx.drafters.base import Drafter
from mtplx.models.rows import BatchedTarget, RowOutput
from mtplx.request import SamplerConfig
from mtplx.sampling.fast_path import sample_logits, verify_sampled_row
from mtplx.sampling.mlx_ops import mx_apply_penalties, mx_verify_greedy
from mtplx.sequence import Sequence


def cycle_uniforms(seed: int, position: int, num_draft: int) -> mx.array:
    """[2k + 1] float32 uniforms in [0, 1) for a cycle starting at ``position``: k for drawing
    draft tokens, k for accepting them, one for the recovered / bonus token. An independent
    stream per (request seed, position), so a seeded request replays exactly under the same
    depth schedule, alone or in any batch, and no two cycles of a request share uniforms."""
    return mx.array(cycle_uniforms_np(seed, position, num_draft))


def cycle_uniforms_np(seed: int, position: int, num_draft: int) -> np.ndarray:
    """``cycle_uniforms`` as a NumPy array."""
    rng = np.random.default_rng([seed, position])
    return rng.random(2 * num_draft + 1, dtype=np.float32)


def position_counts(token_counts: mx.array | None, draft_tokens: mx.array) -> mx.array | None:
    """Penalty counts at each of the k+1 verify positions: the committed counts plus the
    earlier draft tokens of the cycle. token_counts: [V]; draft_tokens: [k] -> [k+1, V]."""
    if token_counts is None:
        return None
    vocab_size = token_counts.shape[-1]
    one_hot = (draft_tokens[:, None] == mx.arange(vocab_size)[None]).astype(token_counts.dtype)
    earlier = mx.concatenate([mx.zeros((1, vocab_size), token_counts.dtype), mx.cumsum(one_hot, 0)])
    return token_counts[None] + earlier


# -- plain rows, one step ahead ------------------------------------------------------------


def plain_input(sequence: Sequence, ahead: Ahead | None) -> mx.array:
    """[1] int32: what a plain row feeds the forward: the lazy draw of its queued forward
    ``ahead``, or (None) its newest committed token."""
    if ahead is not None:
        return ahead.sample
    return mx.array([sequence.tokens[-1]], mx.int32)


def _fed_position(sequence: Sequence, fed_ahead: bool) -> int:
    """The position of the token a plain row feeds: the one after its committed tokens when
    it feeds a queued forward's draw (``fed_ahead``), else its newest committed token's."""
    return len(sequence.tokens) - (0 if fed_ahead else 1)


def queue_plain(sequence: Sequence, output: RowOutput, fed_ahead: bool = False) -> Ahead:
    """The queued forward of ``plain_input`` and the lazy plain draw of the token after it,
    with the uniforms ``verify`` at depth 0 would use there. ``fed_ahead``: the row fed a
    queued forward's draw. Needs no penalties."""
    index = _fed_position(sequence, fed_ahead)
    logits = output.asked_logits()  # [1, V]
    sample = sample_logits(logits, sequence.config, cycle_uniforms(sequence.seed, index + 1, 0))
    return Ahead(logits, output.hidden, sample)


def queue_plain_rows(
    sequences: list[Sequence], outputs: list[RowOutput], fed_ahead: list[bool]
) -> list[Ahead]:
    """``queue_plain`` for many rows at once (``fed_ahead``: each row's), the same draws bit
    for bit: rows whose samplers
    compute the same distribution draw together, one distribution and one inverse-CDF draw
    over their stacked logits (every op works row by row, so a row's bits do not depend on
    its neighbours), each with the uniform of its own seed stream; greedy rows take the
    argmax, which is the token the inverse-CDF draw from the one-hot distribution returns
    (the uniform is below the one-hot's total, 1). A step of 16 rows then builds a few ops
    instead of ~10 per row; ``queue_plain`` stays the reference."""
    groups: dict[tuple, list[int]] = {}
    for index, sequence in enumerate(sequences):
        groups.setdefault(_sampler_key(sequence.config), []).append(index)
    samples: list[mx.array] = [mx.zeros((1,), mx.int32)] * len(sequences)
    for members in groups.values():
        config = sequences[members[0]].config
        logits = [outputs[i].asked_logits() for i in members]
        stacked = mx.concatenate(logits) if len(logits) > 1 else logits[0]  # [G, V]
        if config.is_greedy:
            biased = mx_apply_penalties(stacked.astype(mx.float32), None, config)
            drawn = mx.argmax(biased, axis=-1).astype(mx.int32)
        else:
            uniforms = np.empty(len(members), np.float32)
            for slot, i in enumerate(members):
                sequence = sequences[i]
                index = _fed_position(sequence, fed_ahead[i])
                uniforms[slot] = cycle_uniforms_np(sequence.seed, index + 1, 0)[0]
            drawn = sample_logits(stacked, config, mx.array(uniforms))
        for slot, i in enumerate(members):
            samples[i] = drawn[slot : slot + 1]
    return [
        Ahead(output.asked_logits(), output.hidden, sample)
        for output, sample in zip(outputs, samples, strict=True)
    ]


def _sampler_key(config: SamplerConfig) -> tuple:
    """What the distribution of a row without penalties depends on (not its seed)."""
    if config.is_greedy:
        return ("greedy", tuple(sorted(config.logit_bias.items())))
    return (
        config.temperature,
        config.top_p,
        config.top_k,
        config.min_p,
        tuple(sorted(config.logit_bias.items())),
    )


def close_ahead(drafter: Drafter | None, ahead: Ahead, started: float | None = None) -> CycleResult:
    """A plain cycle that commits the draw of the queued forward ``ahead``. ``started``: when
    the cycle began (default: now), for its verify time."""
    if started is None:
        started = time.perf_counter()
    # Read the draw queued last step, never an array newly derived from it: such an array is
    # part of the graph just queued and is ready only when that whole forward is.
    committed = [scalar_int(ahead.sample)]
    verify_time = time.perf_counter() - started
    if drafter is not None:
        drafter.commit(committed, ahead.hidden[None] if drafter.needs_hidden else None)
    return CycleResult(committed, 0, 0, ahead.logits, 0.0, verify_time)


# -- drafting (or penalised) rows, in step with the forward --------------------------------


def grammar_masks(sequence: Sequence, draft: Draft, vocab_size: int) -> mx.array | None:
    """[k+1, V] bool: the grammar mask at each verify position (the draft's k, then the
    state after the draft, computed now, while the forward runs), or None without a grammar.
    A state that allows nothing gets no mask: what is sampled there is never committed."""
    if sequence.grammar is None:
        return None
    allowed = sequence.grammar.allowed()
    final = mx.ones((vocab_size,), mx.bool_) if allowed is None else mx.array(allowed)
    return mx.stack([*draft.masks, final])


def verify(sequence: Sequence, draft: Draft, output: RowOutput) -> tuple[mx.array, mx.array]:
    """The exact rule over the row's k + 1 target positions, lazily: (num_accepted [1] int32,
    output_tokens [1, k+1] int32; see mx_verify_draft_tokens)."""
    k, planned = draft.num_drafted, draft.num_planned
    target_logits = output.asked_logits()
    if sequence.config.is_greedy:  # every draft is greedy too: one-hot q at its token
        logits = mx_apply_penalties(
            target_logits.astype(mx.float32),
            position_counts(sequence.token_counts, draft.tokens),
            sequence.config,
        )
        masks = grammar_masks(sequence, draft, target_logits.shape[-1])
        if masks is not None:
            logits = mx.where(masks, logits, -mx.inf)
        if fused_layer.available():  # one node where MLX's ops are 9
            return fused_layer.greedy_verdict(logits, draft.tokens)
        return mx_verify_greedy(logits[None], draft.tokens[None])  # [1, k+1, V]
    # One node where the kernel serves (``fast_path.verify_sampled_row``), where MLX's ops
    # are ~20 over [k+1, V].
    return verify_sampled_row(
        target_logits,
        sequence.config,
        draft.tokens,
        draft.qs[:k],
        draft.uniforms,
        planned,
        2 * planned,
        position_counts(sequence.token_counts, draft.tokens),
        grammar_masks(sequence, draft, target_logits.shape[-1]),
    )


def verify_rows(
    rows: list[tuple[Sequence, Draft, RowOutput]],
) -> list[tuple[mx.array, mx.array]]:
    """``verify`` for many rows. Where the greedy verdict's kernel serves, row by row: a
    plain-argmax row's verdict is then one node (``fused_layer.greedy_verdict``), where
    taking the rows together with MLX's ops is ~15 nodes and two slices a row. Elsewhere
    the rows whose rule is a plain argmax (greedy, no penalties, bias or grammar) once over
    their flattened positions, one argmax over every such row's k+1 logits and the accept
    counts of all from the padded [rows, max k + 1] table of its ids; the others row by
    row. The argmax of a position does not depend on the other positions, so each verdict
    is bitwise ``verify``'s."""
    if fused_layer.available():
        return [verify(*row) for row in rows]
    verdicts: list[tuple[mx.array, mx.array] | None] = [None] * len(rows)
    flat = [
        i
        for i, (sequence, _, _) in enumerate(rows)
        if sequence.grammar is None and _argmax_rule(sequence.config)
    ]
    if len(flat) > 1:
        together = _verify_argmax_rows([rows[i][1] for i in flat], [rows[i][2] for i in flat])
        for i, verdict in zip(flat, together, strict=True):
            verdicts[i] = verdict
    return [
        verdict if verdict is not None else verify(*row)
        for row, verdict in zip(rows, verdicts, strict=True)
    ]


def _argmax_rule(config: SamplerConfig) -> bool:
    """Whether a row's verdict is the argmax of its raw logits (``verify_rows``); a grammar
    is checked by the caller's row (``Sequence.grammar``)."""
    return config.is_greedy and not config.has_penalties and not config.logit_bias


def _verify_argmax_rows(
    drafts: list[Draft], outputs: list[RowOutput]
) -> list[tuple[mx.array, mx.array]]:
    """``mx_verify_greedy`` over rows of different depths at once: per row (num_accepted
    [1] int32, output_tokens [1, k+1] int32), the ints ``verify`` gives."""
    ks = [d.num_drafted for d in drafts]
    width = max(ks) + 1
    logits = mx.concatenate([o.asked_logits() for o in outputs])  # [sum (k+1), V]
    greedy = mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32)  # [sum (k+1)]
    starts = np.cumsum([0, *(k + 1 for k in ks)])[:-1]
    draft_starts = np.cumsum([0, *ks])[:-1]
    positions = np.arange(width)[None]  # [1, width]
    k_col = np.array(ks)[:, None]  # [B, 1]
    table = greedy[mx.array(starts[:, None] + np.minimum(positions, k_col))]  # [B, width]
    drafted = mx.concatenate([d.tokens.astype(mx.int32) for d in drafts])  # [sum k]
    real = positions < k_col  # [B, width]: a draft token there (the last column never)
    where = np.where(real, draft_starts[:, None] + positions, 0)
    padded = (
        mx.where(mx.array(real), drafted[mx.array(where)], -1)
        if drafted.size
        else mx.full((len(ks), width), -1, mx.int32)
    )  # [B, width], -1 where no draft: never an argmax
    matches = (padded[:, :-1] == table[:, :-1]).astype(mx.int32)
    num_accepted = mx.sum(mx.cumprod(matches, axis=-1), axis=-1).astype(mx.int32)  # [B]
    # The accepted drafts are the argmaxes at their positions and the token after them the
    # argmax there: the committed tokens are the table's up to the first mismatch.
    cols = mx.array(positions.astype(np.int32))  # [1, width]
    output_tokens = mx.where(cols <= num_accepted[:, None], table, -1).astype(mx.int32)
    return [(num_accepted[b : b + 1], output_tokens[b : b + 1, : k + 1]) for b, k in enumerate(ks)]


def commit(
    target: BatchedTarget,
    sequence: Sequence,
    draft: Draft,
    output: RowOutput,
    num_accepted_array: mx.array,
    output_tokens: mx.array,
    verify_time: float,
) -> CycleResult:
    """Read the (evaluated) verdict, roll the row back past rejected drafts and keep the
    drafter in step. ``sequence.tokens`` is left to the caller."""
    num_accepted = scalar_int(num_accepted_array)
    committed = int_rows(output_tokens)[0][: num_accepted + 1]  # no new op (``close_queued``)
    num_rejected = draft.num_drafted - num_accepted
    grammar = sequence.grammar
    if grammar is not None:
        grammar.rollback(num_rejected)
        if grammar.finished:  # the accepted drafts ended it: what follows was not constrained
            committed = committed[:-1]
        else:
            grammar.consume(committed[-1])
    if num_rejected:
        if draft.checkpoint is None:
            target.trim(sequence.row, num_rejected)
        else:
            # Recurrent state cannot be trimmed: restore it and re-run the accepted prefix.
            target.rollback(sequence.row, draft.checkpoint)
            inputs = draft.inputs(sequence.tokens[-1])[: num_accepted + 1]
            mx.eval(target.forward([sequence.row], [inputs])[0].hidden)
    drafter = sequence.drafter
    if drafter is not None:
        hidden = output.hidden[None, : len(committed)] if drafter.needs_hidden else None
        drafter.commit(committed, hidden)
    return CycleResult(
        committed=committed,
        num_drafted=draft.num_drafted,
        num_accepted=num_accepted,
        target_logits=output.asked_logits()[: len(committed)],
        draft_time=draft.draft_time,
        verify_time=verify_time,
    )


# -- drafting rows, one step ahead --------------------------------------------------------


def commits_lazily(sequence: Sequence) -> bool:
    """Whether the row's drafting cycles can run one step ahead: its drafter takes lazy
    commits, and nothing of the next cycle needs the verdict on the host (penalty counts,
    grammar states do)."""
    return (
        sequence.drafter is not None
        and sequence.drafter.commits_lazily
        and not sequence.config.has_penalties
        and sequence.grammar is None
    )


def last_committed(sequence: Sequence, queued: QueuedDraft | None) -> mx.array:
    """[1] int32: the row's newest committed token, lazy after a ``queued`` drafting cycle."""
    if queued is None:
        return mx.array([sequence.tokens[-1]], mx.int32)
    if queued.last is not None:
        return queued.last
    return mx.take(queued.output_tokens.reshape(-1), queued.num_accepted)


def queue_draft(
    target: BatchedTarget,
    sequence: Sequence,
    draft: Draft,
    output: RowOutput,
    source: str | None,
    started: float,
    verdict: tuple[mx.array, mx.array] | None = None,
) -> QueuedDraft:
    """Verify lazily (``verdict``: the row's, from ``verify_rows``) and bring the row and the
    drafter to the verdict without reading it: the row drops the rejected drafts lazily, the
    drafter gets every verified position's pair with the count that holds."""
    num_accepted, output_tokens = verdict or verify(sequence, draft, output)
    last = None
    if fused_layer.available():  # one node where MLX's ops are 7
        num_rejected, num_valid, tokens, last = fused_layer.verdict_counts(
            num_accepted, output_tokens
        )
    else:
        accepted = num_accepted.reshape(())
        num_rejected = draft.num_drafted - accepted
        num_valid, tokens = accepted + 1, output_tokens.reshape(-1)
    target.trim_lazily(sequence.row, num_rejected)
    drafter = sequence.drafter
    assert drafter is not None, "only drafting rows queue their cycles"
    drafter.commit_lazy(tokens, output.hidden[None], num_valid)
    return QueuedDraft(
        draft, output, num_accepted, output_tokens, source, started, num_rejected, last
    )


def close_queued(target: BatchedTarget, sequence: Sequence, queued: QueuedDraft) -> CycleResult:
    """Read a queued drafting cycle's verdict; settle the row and the drafter by it."""
    # Read only arrays the queued cycle's own evaluation computed (``_queue_ahead`` evaluates
    # them): one newly derived from them (a slice) would be computed after the cycle queued
    # since, and reading it would wait for that whole cycle, leaving the host idle instead
    # of building the next step while it computes.
    num_accepted = scalar_int(queued.num_accepted)
    committed = int_rows(queued.output_tokens)[0][: num_accepted + 1]
    verify_time = time.perf_counter() - queued.started
    num_rejected = target.settle(sequence.row)
    assert num_rejected == queued.draft.num_drafted - num_accepted
    assert sequence.drafter is not None, "only drafting rows queue their cycles"
    sequence.drafter.settle(num_rejected)
    return CycleResult(
        committed=committed,
        num_drafted=queued.draft.num_drafted,
        num_accepted=num_accepted,
        target_logits=queued.output.asked_logits()[: len(committed)],
        draft_time=queued.draft.draft_time,
        verify_time=verify_time,
    )
