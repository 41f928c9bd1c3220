"""Prompts into the target: one path for every target. A target whose states depend on how
a prompt is split (one forward per row: hybrid recurrent, MLA) gets the prompt in chunks the
prompt alone fixes, as chunks of the step's one forward beside decoding rows; its outputs
stay those of the row alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mtplx.engine import Engine
from mtplx.prefill import fixed_chunks
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent
from tests.test_engine import load_fixture

GREEDY = SamplerConfig(temperature=0.0)


def _waiting(prompt_length: int, num_prefilled: int) -> Any:
    """A stand-in for a sequence whose prompt is being fed."""
    return SimpleNamespace(
        tokens=list(range(prompt_length)),
        num_prompt_tokens=prompt_length,
        num_prefilled=num_prefilled,
    )


def test_fixed_chunks_are_the_prompts_own_oldest_first_within_the_budget() -> None:
    long, middle, short = _waiting(100, 64), _waiting(70, 64), _waiting(20, 0)
    chunks = fixed_chunks([long, middle, short], 40, 32)
    # The long prompt's next chunk is [64, 96); the middle one's last chunk (6 tokens) still
    # fits beside it, the short prompt's 20 tokens do not.
    assert [(s, c) for s, c in chunks] == [
        (long, list(range(64, 96))),
        (middle, [64, 65, 66, 67, 68, 69]),
    ]
    # The first waiting prompt's chunk goes whatever the budget: every step feeds some.
    assert fixed_chunks([short, long], 4, 32) == [(short, list(range(20)))]
    assert fixed_chunks([], 40, 32) == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A family of one forward per row (hybrid recurrent)."""
    return load_fixture("qwen3_next", tmp_path_factory.mktemp("per_row"))


def _tokens(engine: Engine, request: GenerationRequest) -> list[int]:
    return [e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent)]


def test_a_per_row_targets_prompt_rides_in_the_steps_forward_in_fixed_chunks(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a decoding stream, a long prompt feeds chunks of ``prefill_chunk_size`` at
    multiples of it, in the same forwards as the stream's tokens; both rows' outputs are
    those they give alone."""
    assert not engine.batched.resumes_anywhere and not engine.batched.max_packed_rows
    vocab = engine.vocab_size
    prompt = [(11 * j * j + 5) % (vocab - 3) + 3 for j in range(150)]
    stream_request = GenerationRequest([5, 6, 7], GREEDY, 30, drafter="none")
    long_request = GenerationRequest(prompt, GREEDY, 4, drafter="none")
    alone = [_tokens(engine, stream_request), _tokens(engine, long_request)]

    long_rows: list[Any] = []  # the long prompt's row, once added
    chunks: list[tuple[int, int]] = []  # (its length before, tokens fed) per forward
    together: list[bool] = []  # whether that forward fed another row too
    forward = engine.batched.forward

    def recording(rows: list[Any], tokens: list[Any], logits: Any = "all") -> Any:
        for row, fed in zip(rows, tokens, strict=True):
            if long_rows and row is long_rows[0] and row.length < len(prompt):
                chunks.append((row.length, int(fed.shape[0])))
                together.append(len(rows) > 1)
        return forward(rows, tokens, logits)

    monkeypatch.setattr(engine.batched, "forward", recording)
    got: dict[Any, list[int]] = {}

    def step() -> None:
        for sequence, event in engine.step():
            if isinstance(event, TokenEvent):
                got.setdefault(sequence, []).append(event.token_id)

    stream = engine.add(stream_request)
    while stream not in got:
        step()
    long = engine.add(long_request)
    long_rows.append(long.row)
    while engine.running:
        step()
    size = engine.prefill_chunk_size
    assert chunks == [(start, min(size, len(prompt) - start)) for start in range(0, 150, size)]
    assert all(together)  # each chunk in a forward with the stream's token
    assert [got[stream], got[long]] == alone
