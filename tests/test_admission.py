"""Admission on KV memory (``Admission.has_room_for``, ``validate``): a request starts when
its prompt's KV fits within ``max_kv_bytes`` beside what the running rows hold and what
the prompts admitted before their first forward will take; a prompt whose KV alone is over
the bound is refused before any work; a request alone always starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mtplx.engine import Engine
from mtplx.errors import InvalidParameter
from mtplx.request import GenerationRequest, SamplerConfig
from tests.test_engine import load_fixture

GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return load_fixture("llama_mtp", tmp_path_factory.mktemp("llama_mtp"))


@pytest.fixture
def bounded(engine: Engine) -> Iterator[Engine]:
    """The engine, its bound and batch restored after the test."""
    yield engine
    engine.max_kv_bytes = None
    for sequence in list(engine.running):
        engine.abort(sequence)


def _request(length: int, max_tokens: int = 2) -> GenerationRequest:
    return GenerationRequest(list(range(3, 3 + length)), GREEDY, max_tokens=max_tokens)


def _prompt_kv(engine: Engine, length: int) -> int:
    nbytes = engine.prompt_kv_bytes(length)
    assert nbytes  # the slot store knows a prompt's KV before its first forward
    return nbytes


def test_a_prompt_is_priced_as_the_positions_it_fills(engine: Engine) -> None:
    per_position = _prompt_kv(engine, 1)
    assert _prompt_kv(engine, 40) == 40 * per_position
    assert engine.kv_bytes_due == 0


def test_a_request_waits_until_its_prompts_kv_fits(bounded: Engine) -> None:
    # Room for the first prompt and half of a second one: the second waits (its KV would
    # pass the bound), a prompt small enough for what is left does not.
    engine = bounded
    first, second, small = _request(40), _request(40), _request(10)
    engine.max_kv_bytes = engine.kv_nbytes + _prompt_kv(engine, 40) + _prompt_kv(engine, 20)
    assert engine.has_room_for(first)
    running = engine.add(first)
    assert engine.has_room  # the KV held and due is under the bound...
    assert not engine.has_room_for(second)  # ...but not with the second prompt's
    with pytest.raises(RuntimeError, match="KV"):
        engine.add(second)
    assert engine.has_room_for(small)
    while not running.finished:
        engine.step()
    engine.abort(running)
    assert not engine.running and engine.kv_bytes_due == 0 and engine.has_room_for(second)


def test_a_running_row_holds_new_requests_back(bounded: Engine) -> None:
    # The bound fits the prompt alone: once the row holds its KV, nothing joins it; once
    # it has finished, the next starts.
    engine = bounded
    request = _request(3, max_tokens=4)
    engine.max_kv_bytes = _prompt_kv(engine, 3)
    assert engine.has_room_for(request)  # an idle engine admits what fits alone
    sequence = engine.add(request)
    engine.step()
    assert engine.kv_nbytes > 0 and not engine.has_room and not engine.has_room_for(request)
    while not sequence.finished:
        engine.step()
    engine.abort(sequence)
    assert not engine.running and engine.has_room_for(request)


def test_prompts_admitted_before_their_first_forward_count(bounded: Engine) -> None:
    # Rows take their KV at their first forward: a burst admitted within one step is still
    # held to the bound (here what the engine holds idle plus half the first prompt's KV).
    engine = bounded
    per_prompt = _prompt_kv(engine, 40)
    engine.max_kv_bytes = engine.kv_nbytes + per_prompt // 2
    first = engine.add(_request(40))
    assert not engine.has_room and not engine.has_room_for(_request(1))
    assert engine.kv_nbytes + engine.kv_bytes_due >= per_prompt
    while not first.finished:
        engine.step()
    engine.abort(first)
    assert not engine.running and engine.has_room and engine.kv_bytes_due == 0


def test_a_prompt_whose_kv_alone_is_over_the_bound_is_refused(
    bounded: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = bounded
    engine.max_kv_bytes = _prompt_kv(engine, 40)
    engine.validate(_request(40))  # exactly at the bound: it fits
    with pytest.raises(InvalidParameter) as refused:
        engine.validate(_request(41))
    assert refused.value.param == "prompt_ids"
    assert refused.value.code == "context_length_exceeded"
    assert "41 tokens" in str(refused.value) and "at most 40 prompt tokens fit" in str(
        refused.value
    )
    with pytest.raises(InvalidParameter):
        engine.add(_request(41))
    assert not engine.running and engine.num_orphan_rows == 0
    engine.max_kv_bytes = None
    engine.validate(_request(41))
    # A target that cannot price a prompt before its first block admits it alone.
    engine.max_kv_bytes = 1
    monkeypatch.setattr(engine, "prompt_kv_bytes", lambda num_tokens: None)
    engine.validate(_request(41))
    assert engine.has_room_for(_request(41))
    assert engine.kv_bytes_due == 0


def test_no_bound_admits_up_to_the_slots(bounded: Engine) -> None:
    engine = bounded
    rows = [engine.add(_request(5)) for _ in range(engine.max_num_seqs)]
    assert not engine.has_room and not engine.has_room_for(_request(1))
    with pytest.raises(RuntimeError, match="full"):
        engine.add(_request(1))
    engine.abort(rows[0])
    assert engine.has_room_for(_request(1000))
