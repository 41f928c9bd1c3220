"""The prompt chunks of a step (``Schedule._prefill_chunks``) on stand-in sequences:
beside decoding streams a step's prompt chunks stay within a budget in cost whatever the
prompts' depth, every waiting prompt advances, and none starves when the budget is short;
alone, a prompt feeds a whole forward. (The chunks' outputs are checked against rows fed
alone in ``tests/test_engine_batching.py`` and ``tests/test_prefill.py``.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mtplx.prefill_cost import chunk_cost
from mtplx.schedule import BESIDE_STREAMS_TOKENS, Schedule
from mtplx.sequence import Status

KEYS_PER_TOKEN = 2048  # the default model's price of a token


def _prompt(length: int, prefilled: int) -> Any:
    """A stand-in for a sequence whose prompt is being fed (each one its own: stand-ins
    with equal fields would compare equal)."""
    return SimpleNamespace(
        key=object(),
        status=Status.PREFILLING,
        tokens=list(range(length)),
        num_prompt_tokens=length,
        num_prefilled=prefilled,
    )


def _schedule(prompts: list[Any], resumes_anywhere: bool = True, step: int = 0) -> Schedule:
    """A schedule over ``prompts`` with the default model's settings (the quantized path:
    384 tokens a forward)."""
    schedule = Schedule()
    schedule.batched = SimpleNamespace(  # type: ignore[assignment]
        max_packed_rows=384 if resumes_anywhere else 0,
        max_prefill_tokens=384,
        resumes_anywhere=resumes_anywhere,
    )
    schedule.prefix = None
    schedule.running = prompts
    schedule.prefill_budget = 256
    schedule.prefill_chunk_size = 32
    schedule.keys_per_token = KEYS_PER_TOKEN
    schedule.num_steps = step
    return schedule


def _cost(chunks: list[tuple[Any, list[int]]]) -> int:
    return sum(chunk_cost(s.num_prefilled, len(c), KEYS_PER_TOKEN) for s, c in chunks)


def _feed(chunks: list[tuple[Any, list[int]]]) -> None:
    for sequence, chunk in chunks:
        assert (
            chunk == sequence.tokens[sequence.num_prefilled : sequence.num_prefilled + len(chunk)]
        )
        sequence.num_prefilled += len(chunk)


def test_shallow_prompts_beside_streams_share_the_steps_tokens() -> None:
    prompts = [_prompt(5000, 0) for _ in range(4)]
    chunks = _schedule(prompts)._prefill_chunks(num_decode_tokens=3)
    # 125 tokens' worth at an empty context: 31 tokens each (a chunk's own keys count too).
    assert [len(c) for _, c in chunks] == [31, 31, 31, 31]
    assert _cost(chunks) <= (BESIDE_STREAMS_TOKENS - 3) * KEYS_PER_TOKEN


def test_deep_prompts_beside_streams_feed_fewer_tokens_within_the_same_cost() -> None:
    budget = (BESIDE_STREAMS_TOKENS - 3) * KEYS_PER_TOKEN
    for depth in (1000, 4000, 16_000, 60_000):
        prompts = [_prompt(depth + 1000, depth + 10 * i) for i in range(4)]
        chunks = _schedule(prompts)._prefill_chunks(num_decode_tokens=3)
        assert [s for s, _ in chunks] == prompts  # every waiting prompt advances
        assert _cost(chunks) <= budget
        assert sum(len(c) for _, c in chunks) < 125
    # Four prompts 4,000 positions deep: 42 tokens in all, not 4 x 31 (what the first
    # ones leave of their shares goes to the later ones).
    prompts = [_prompt(5000, 4000) for _ in range(4)]
    chunks = _schedule(prompts)._prefill_chunks(num_decode_tokens=3)
    assert [len(c) for _, c in chunks] == [10, 10, 11, 11]


def test_one_prompt_a_step_takes_its_turn_when_the_budget_is_short() -> None:
    # Decoding tokens leave one token's worth: too little for any prompt this deep, so one
    # token a step goes to the prompts in turn.
    prompts = [_prompt(9000, 8000 + i) for i in range(3)]
    fed = []
    for step in range(6):
        chunks = _schedule(prompts, step=step)._prefill_chunks(BESIDE_STREAMS_TOKENS - 1)
        assert [len(c) for _, c in chunks] == [1]
        fed.append(prompts.index(chunks[0][0]))
        _feed(chunks)
    assert fed == [0, 1, 2, 0, 1, 2]
    # With no token left at all the step still feeds one (as it always has).
    chunks = _schedule(prompts)._prefill_chunks(BESIDE_STREAMS_TOKENS + 8)
    assert [len(c) for _, c in chunks] == [1]


def test_a_prompt_alone_feeds_a_whole_forward_whatever_its_depth() -> None:
    for depth in (0, 4000):
        prompts = [_prompt(depth + 1000, depth)]
        chunks = _schedule(prompts)._prefill_chunks(0, idle=True)
        assert [len(c) for _, c in chunks] == [384]
    prompts = [_prompt(5000, 4000) for _ in range(4)]
    chunks = _schedule(prompts)._prefill_chunks(0, idle=True)
    assert [len(c) for _, c in chunks] == [96, 96, 96, 96]


def test_fixed_chunks_beside_streams_fit_the_cost() -> None:
    # A target whose states depend on the split: whole chunks of 32, oldest first, those
    # whose cost fits (the oldest one always); two chunks 4,000 deep cost more than 125
    # tokens at an empty context, one and a short prompt's 20 tokens do not.
    prompts = [_prompt(5000, 4000), _prompt(5000, 4000), _prompt(20, 0)]
    schedule = _schedule(prompts, resumes_anywhere=False)
    chunks = schedule._prefill_chunks(num_decode_tokens=3)
    assert [(prompts.index(s), len(c)) for s, c in chunks] == [(0, 32), (2, 20)]
    assert _cost(chunks) <= (BESIDE_STREAMS_TOKENS - 3) * KEYS_PER_TOKEN
    prompts[0].num_prefilled = 60_000  # however deep, the oldest prompt's chunk goes
    prompts[0].tokens = prompts[0].tokens * 13
    prompts[0].num_prompt_tokens = len(prompts[0].tokens)
    assert [prompts.index(s) for s, _ in schedule._prefill_chunks(3)] == [0]
    assert [prompts.index(s) for s, _ in schedule._prefill_chunks(0, idle=True)] == [0, 1, 2]


def test_a_short_remainder_leaves_its_share_to_the_prompts_behind_it() -> None:
    # Oldest first: what a prompt near its end does not take goes to the later ones.
    prompts = [_prompt(5003, 5000), _prompt(5000, 0), _prompt(5000, 0)]
    chunks = _schedule(prompts)._prefill_chunks(0, idle=True)
    assert [len(c) for _, c in chunks] == [3, 190, 191]
