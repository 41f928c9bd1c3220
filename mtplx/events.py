"""What a committed cycle becomes: token events (with log probabilities when asked) and the
request's speculative counters."""

from __future__ import annotations

import mlx.core as mx

from mtplx.arrays import float_list, float_rows, int_list, int_rows, scalar_float
from mtplx.cycle import CycleResult
from mtplx.request import GenerationStats, PromptLogprob, TokenEvent


def token_event(
    result: CycleResult, index: int, token: int, text: str, logprobs: int | None
) -> TokenEvent:
    drafted = index < result.num_accepted
    if logprobs is None:
        return TokenEvent(token, text, drafted)
    logits = result.target_logits[index].astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top: tuple[tuple[int, float], ...] = ()
    if logprobs > 0:
        top_ids = mx.argpartition(-log_probs, kth=logprobs - 1)[:logprobs]
        pairs = zip(int_list(top_ids), float_list(log_probs[top_ids]), strict=True)
        top = tuple(sorted(pairs, key=lambda pair: -pair[1]))
    return TokenEvent(token, text, drafted, scalar_float(log_probs[token]), top)


def prompt_logprobs(
    logits: mx.array, tokens: list[int], start: int, num_top: int
) -> list[PromptLogprob]:
    """Score a prompt chunk: ``logits`` [T, V] of the chunk's positions start .. start + T - 1
    of the prompt ``tokens``; position p predicts token p + 1 (the last prompt position
    predicts the output, not a prompt token). The first prompt token, which nothing
    predicts, scores None."""
    scored = [PromptLogprob(tokens[0], None)] if start == 0 else []
    num = min(logits.shape[0], len(tokens) - 1 - start)
    if num <= 0:
        return scored
    logits = logits[:num].astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [num, V]
    targets = mx.array(tokens[start + 1 : start + 1 + num], mx.int32)
    chosen = mx.take_along_axis(log_probs, targets[:, None], axis=-1)  # [num, 1]
    ranks = int_list(mx.sum(log_probs > chosen, axis=-1) + 1)
    chosen_logprobs = float_list(chosen[:, 0])
    tops: list[tuple[tuple[int, float], ...]] = [()] * num
    if num_top > 0:
        top_ids = mx.argpartition(-log_probs, kth=num_top - 1, axis=-1)[:, :num_top]
        top_values = mx.take_along_axis(log_probs, top_ids, axis=-1)
        tops = [
            tuple(sorted(zip(ids, values, strict=True), key=lambda pair: -pair[1]))
            for ids, values in zip(int_rows(top_ids), float_rows(top_values), strict=True)
        ]
    scored += [
        PromptLogprob(tokens[start + 1 + i], chosen_logprobs[i], ranks[i], tops[i])
        for i in range(num)
    ]
    return scored


def record_cycle(stats: GenerationStats, result: CycleResult) -> None:
    """Add one cycle to the request's counters."""
    stats.num_cycles += 1
    stats.draft_time += result.draft_time
    stats.verify_time += result.verify_time
    if result.num_drafted == 0:
        return
    stats.num_drafts += 1
    stats.num_draft_tokens += result.num_drafted
    stats.num_accepted_tokens += result.num_accepted
    for counts, limit in (
        (stats.drafted_per_position, result.num_drafted),
        (stats.accepted_per_position, result.num_accepted),
    ):
        counts.extend([0] * (limit - len(counts)))
        for position in range(limit):
            counts[position] += 1
    if result.num_accepted < result.num_drafted:
        stats.num_recovered += 1
    else:
        stats.num_bonus += 1
