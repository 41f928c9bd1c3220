"""One draft / verify / accept / commit cycle for one sequence.

A cycle with no draft tokens is plain decoding: the target forward over the last committed
token alone, then a sample from p. With k draft tokens the target runs once over
``[last, d1 .. dk]``, the exact rule of ``mtplx.sampling`` accepts a prefix and emits the
recovered or bonus token, and the target cache is rolled back past the rejected drafts.

Plain cycles can run one step ahead (``plain_cycle_ahead``), as mlx-lm's generate loop does:
the forward of the token being committed is queued (``mx.async_eval``) before that token is
read, so building the next graph in Python overlaps the current compute. The queued forward
(an ``Ahead``) then serves the next cycle: a plain one commits its draw and queues the next
forward; before a drafting cycle, ``close_ahead`` commits its draw without queuing another,
and the drafting cycle verifies from the position after it. (Verifying the drafts against
the queued forward's logits instead would spend that forward's token: k drafts would commit
at most k + 1 tokens for the queued forward and a k-token verify, where closing first
commits up to k + 2 for it and a (k + 1)-token verify, which costs little more.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx import cache as cache_ops
from mtplx.drafters.base import Drafter, DraftSampler
from mtplx.models.base import TargetModel
from mtplx.sampling import (
    SamplerConfig,
    mx_distribution_from_logits,
    mx_sample,
    mx_verify_draft_tokens,
)


@dataclass
class SequenceState:
    """The committed history of one sequence and everything tied to it."""

    tokens: list[int]  # prompt + committed output; the newest one is not in ``cache`` yet
    num_prompt_tokens: int
    cache: list[Any]  # the target's cache
    seed: int  # the request's own random stream: see cycle_uniforms
    token_counts: mx.array | None = None  # [V] output token counts, when penalties are on
    recurrent: bool = field(init=False)  # cache has state that cannot be trimmed

    def __post_init__(self) -> None:
        self.recurrent = not cache_ops.is_trimmable(self.cache)

    @property
    def num_output_tokens(self) -> int:
        """Tokens committed after the prompt."""
        return len(self.tokens) - self.num_prompt_tokens


@dataclass
class CycleResult:
    """What one cycle committed."""

    committed: list[int]  # accepted draft tokens, then the recovered / bonus / sampled token
    num_drafted: int
    num_accepted: int
    target_logits: mx.array  # [n, V] raw target logits at the committed tokens' positions
    draft_time: float
    verify_time: float


def cycle_uniforms(seed: int, position: int, num_draft: int) -> mx.array:
    """[2k + 1] float32 uniforms in [0, 1) for a cycle starting at ``position``: k for drawing
    draft tokens, k for accepting them, one for the recovered / bonus token. An independent
    stream per (request seed, position), so a seeded request replays exactly under the same
    depth schedule, and no two cycles of a request share uniforms."""
    rng = np.random.default_rng([seed, position])
    return mx.array(rng.random(2 * num_draft + 1, dtype=np.float32))


def position_counts(token_counts: mx.array | None, draft_tokens: mx.array) -> mx.array | None:
    """Penalty counts at each of the k+1 verify positions: the committed counts plus the
    earlier draft tokens of the cycle. token_counts: [V]; draft_tokens: [k] -> [k+1, V]."""
    if token_counts is None:
        return None
    vocab_size = token_counts.shape[-1]
    one_hot = (draft_tokens[:, None] == mx.arange(vocab_size)[None]).astype(token_counts.dtype)
    earlier = mx.concatenate([mx.zeros((1, vocab_size), token_counts.dtype), mx.cumsum(one_hot, 0)])
    return token_counts[None] + earlier


@dataclass
class Ahead:
    """The target forward of the newest committed token, already queued: its cache entry is
    written and its outputs are being computed."""

    logits: mx.array  # [1, 1, V]
    hidden: mx.array  # [1, 1, H]
    sample: mx.array  # [1] int32, the plain-decoding draw of the next token from these logits


def feed_ahead(
    target: TargetModel,
    state: SequenceState,
    config: SamplerConfig,
    token: mx.array,
    index: int,
) -> Ahead:
    """Queue the target forward of ``token`` ([1] int32, may be lazy), the token at
    ``index`` of the sequence, and the plain draw of the token after it (with the uniforms
    ``run_cycle`` at depth 0 would use at index + 1). Needs no penalties."""
    logits, hidden = target(token[None], state.cache)  # [1, 1, V], [1, 1, H]
    probs = mx_distribution_from_logits(logits[0], config)  # [1, V]
    sample = mx_sample(probs, cycle_uniforms(state.seed, index + 1, 0)).astype(mx.int32)
    mx.async_eval(logits, hidden, sample)
    return Ahead(logits, hidden, sample)


def plain_cycle_ahead(
    target: TargetModel,
    drafter: Drafter | None,
    state: SequenceState,
    config: SamplerConfig,
    ahead: Ahead | None,
) -> tuple[CycleResult, Ahead]:
    """A plain-decoding cycle that leaves the next forward queued. ``ahead``: the queued
    forward of ``state.tokens[-1]`` (None: queue it now). Returns the cycle and the queued
    forward of the token it committed. The token equals ``run_cycle``'s at depth 0; a
    request that ends after it leaves one extra cache entry, which dies with the cache."""
    if config.has_penalties:
        raise ValueError("running ahead needs the penalty counts of an uncommitted token")
    started = time.perf_counter()
    last_index = len(state.tokens) - 1
    if ahead is None:
        last = mx.array([state.tokens[-1]], mx.int32)
        ahead = feed_ahead(target, state, config, last, last_index)
    following = feed_ahead(target, state, config, ahead.sample, last_index + 1)
    return close_ahead(drafter, ahead, started), following


def close_ahead(drafter: Drafter | None, ahead: Ahead, started: float | None = None) -> CycleResult:
    """A plain cycle that only commits the draw of the queued forward ``ahead`` and queues
    nothing: what precedes a drafting cycle, which then feeds this token itself. ``started``:
    when the cycle began (default: now), for its verify time."""
    if started is None:
        started = time.perf_counter()
    # Read the draw queued last cycle, never an array newly derived from it: such an array is
    # part of the graph just queued and is ready only when that whole forward is (measured:
    # 80 -> 61 ms a token, the same as mlx-lm's loop).
    committed = [int(ahead.sample.item())]
    verify_time = time.perf_counter() - started
    if drafter is not None:
        drafter.commit(committed, ahead.hidden if drafter.needs_hidden else None)
    return CycleResult(committed, 0, 0, ahead.logits[0], 0.0, verify_time)


def run_cycle(
    target: TargetModel,
    drafter: Drafter | None,
    state: SequenceState,
    config: SamplerConfig,
    num_draft: int,
) -> CycleResult:
    """Draft up to ``num_draft`` tokens, verify them in one target forward over
    ``[state.tokens[-1], d1 .. dk]``, commit the result to ``state.cache`` and ``drafter``;
    ``state.tokens`` is left to the caller."""
    position = len(state.tokens)
    uniforms = cycle_uniforms(state.seed, position, num_draft)
    started = time.perf_counter()
    draft_tokens: list[mx.array] = []
    draft_qs: list[mx.array] = []
    if drafter is not None and num_draft > 0:
        sampler = DraftSampler(
            config, target.vocab_size, uniforms[:num_draft], state.token_counts, drafter.draft_vocab
        )
        draft_tokens, draft_qs = drafter.propose(state.tokens, num_draft, sampler)
    num_drafted = len(draft_tokens)
    drafted = mx.stack(draft_tokens).astype(mx.int32) if num_drafted else mx.zeros((0,), mx.int32)
    if num_drafted:
        mx.eval(drafted, draft_qs)
    draft_time = time.perf_counter() - started

    started = time.perf_counter()
    point = cache_ops.checkpoint(state.cache) if state.recurrent and num_drafted else None
    inputs = mx.concatenate([mx.array([state.tokens[-1]], mx.int32), drafted])[None]
    logits, hidden = target(inputs, state.cache)  # [1, k+1, V], [1, k+1, H]
    target_probs = mx_distribution_from_logits(
        logits[0], config, position_counts(state.token_counts, drafted)
    )
    draft_probs = (
        mx.stack(draft_qs)[None]
        if num_drafted
        else mx.zeros((1, 0, target_probs.shape[-1]), mx.float32)
    )
    num_accepted_array, output_tokens = mx_verify_draft_tokens(
        target_probs[None],
        draft_probs,
        drafted[None],
        uniforms[num_draft : num_draft + num_drafted][None],
        uniforms[2 * num_draft :],
    )
    mx.eval(num_accepted_array, output_tokens, hidden)
    num_accepted = int(num_accepted_array.item())
    committed = [int(t) for t in output_tokens[0, : num_accepted + 1].tolist()]

    num_rejected = num_drafted - num_accepted
    if num_rejected:
        if point is None:
            cache_ops.trim(state.cache, num_rejected)
        else:
            # Recurrent state cannot be trimmed: restore it and re-run the accepted prefix.
            cache_ops.rollback(state.cache, point)
            target(inputs[:, : num_accepted + 1], state.cache)
    verify_time = time.perf_counter() - started
    if drafter is not None:
        drafter.commit(committed, hidden[:, : num_accepted + 1] if drafter.needs_hidden else None)
    return CycleResult(
        committed=committed,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        target_logits=logits[0, : num_accepted + 1],
        draft_time=draft_time,
        verify_time=verify_time,
    )
