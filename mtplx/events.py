"""What a committed cycle becomes: token events (with log probabilities when asked) and the
request's speculative counters."""

from __future__ import annotations

import mlx.core as mx

from mtplx.request import GenerationStats, TokenEvent
from mtplx.speculative import CycleResult


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
        pairs = zip(top_ids.tolist(), log_probs[top_ids].tolist(), strict=True)
        top = tuple(sorted(pairs, key=lambda pair: -pair[1]))
    return TokenEvent(token, text, drafted, float(log_probs[token].item()), top)


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
