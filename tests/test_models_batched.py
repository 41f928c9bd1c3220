"""Batched target forwards: a row's outputs do not depend on the other rows, bitwise, and
agree with the model's own forward."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import load
from mtplx.models.batched import IDLE_CAPACITY, PerRowTarget, SlotTarget, batched_target
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint, untie_lm_head


@pytest.fixture(scope="module", params=["float32", "q4", "q4-int8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The llama fixture in float32, and quantized (4-bit affine: its products on the
    invariant quantized kernel, with float32 or int8 activations: MTPLX_ACTIVATIONS is a
    process setting, held for the module's tests of that model)."""
    directory = tmp_path_factory.mktemp("batched")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory)
    quantized = request.param.startswith("q4")
    if quantized:
        quantize_checkpoint(directory, bits=4, group_size=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPLX_ACTIVATIONS", "int8" if request.param == "q4-int8" else "float32")
        loaded = load(directory)
        assert loaded.weights.startswith("affine q4" if quantized else "float32")
        yield loaded


def _prompt(i: int, length: int) -> mx.array:
    return mx.array([(5 + 7 * i + 13 * j * j) % 250 + 3 for j in range(length)], mx.int32)


def _rows(target: SlotTarget, lengths: list[int]):
    rows = []
    for i, length in enumerate(lengths):
        row = target.new_row()
        mx.eval(target.forward([row], [_prompt(i, length)], "last")[0].logits)
        rows.append(row)
    return rows


def test_llama_trunks_get_the_slot_target_and_others_one_forward_per_row(
    model, qwen3_next_checkpoint: Path
) -> None:
    assert isinstance(batched_target(model.target, 4), SlotTarget)
    other = load(qwen3_next_checkpoint)
    per_row = batched_target(other.target, 4)
    assert isinstance(per_row, PerRowTarget) and per_row.recurrent


def test_a_row_alone_and_among_others_gives_the_same_bits(model) -> None:
    target = SlotTarget(model.target, max_rows=16)
    lengths = [3 + 19 * i % 97 for i in range(16)]  # 16 rows of different lengths
    rows = _rows(target, lengths)
    tokens = [mx.array([7, 8, 9, 10, 11, 12][: 1 + i % 6], mx.int32) for i in range(16)]
    together = target.forward(rows, tokens)
    mx.eval([(o.logits, o.hidden) for o in together])
    for row, row_tokens in zip(rows, tokens, strict=True):
        target.trim(row, row_tokens.shape[0])
    for index in (0, 5, 11, 15):
        (alone,) = target.forward([rows[index]], [tokens[index]])
        assert mx.array_equal(alone.logits, together[index].logits).item(), index
        assert mx.array_equal(alone.hidden, together[index].hidden).item(), index
        target.trim(rows[index], tokens[index].shape[0])


def test_slot_rows_match_the_models_own_forward(model) -> None:
    target = SlotTarget(model.target, max_rows=4)
    rows = _rows(target, [9, 30, 4])
    outputs = target.forward(rows, [mx.array([3, 4], mx.int32)] * 3)
    for i, (row, output) in enumerate(zip(rows, outputs, strict=True)):
        assert row.length == [9, 30, 4][i] + 2
        cache = model.target.make_cache()
        history = mx.concatenate([_prompt(i, [9, 30, 4][i]), mx.array([3, 4], mx.int32)])
        logits, _ = model.target(history[None], cache)
        np.testing.assert_allclose(
            np.array(output.logits), np.array(logits[0, -2:]), atol=1e-4, rtol=1e-4
        )


def test_released_slots_are_reused_and_never_shared(model) -> None:
    target = SlotTarget(model.target, max_rows=2)
    first, second = target.new_row(), target.new_row()
    with pytest.raises(RuntimeError, match="slots"):
        target.new_row()
    target.release(first)
    third = target.new_row()
    assert third.slot == 0 and second.slot == 1
    with pytest.raises(ValueError, match="own live slot"):
        target.forward([third, third], [mx.array([1]), mx.array([2])])


def test_an_idle_store_grown_by_a_long_row_is_freed(model) -> None:
    """Once the last row leaves, a store grown past IDLE_CAPACITY is dropped; the next rows
    allocate afresh and give the bits of a fresh target."""
    target = SlotTarget(model.target, max_rows=4)
    (long_row,) = _rows(target, [IDLE_CAPACITY + 1])
    short = target.new_row()
    target.release(long_row)
    assert target._shared.capacity > IDLE_CAPACITY  # a row still runs: the store stays
    target.release(short)
    assert target._shared.capacity == 0 and not target._shared.layers
    (again,) = _rows(target, [40])
    fresh = SlotTarget(model.target, max_rows=4)
    (fresh_row,) = _rows(fresh, [40])
    (got,) = target.forward([again], [mx.array([3, 4])])
    (want,) = fresh.forward([fresh_row], [mx.array([3, 4])])
    assert mx.array_equal(got.logits, want.logits).item()
    assert target._shared.capacity == fresh._shared.capacity


def test_a_long_row_moves_to_a_store_of_its_own_with_the_same_bits(model) -> None:
    """A row that outgrows the shared store moves to a store of its own and attends alone:
    every output (beside two short rows, across the move, in prompt chunks and decode steps)
    is the same bits as with one store for all; the shared store stays short, and the long
    row's store is freed with it."""
    shared = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    split = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    split.shared_capacity = 256
    for target in (shared, split):
        _rows(target, [40, 10])
        target.new_row()
    rows = {id(t): list(t._live.values()) for t in (shared, split)}
    long_prompt = _prompt(5, 300)
    fed = 0
    while fed < 360:
        chunk = long_prompt[fed : fed + 64] if fed < 300 else mx.array([fed % 250 + 3], mx.int32)
        outputs = []
        for target in (shared, split):
            short_a, short_b, long_row = rows[id(target)]
            out = target.forward(
                [short_a, long_row, short_b], [mx.array([fed % 7 + 3]), chunk, mx.array([9])]
            )
            mx.eval([(o.logits, o.hidden) for o in out])
            outputs.append(out)
        for mine, theirs in zip(*outputs, strict=True):
            assert mx.array_equal(mine.logits, theirs.logits).item(), fed
            assert mx.array_equal(mine.hidden, theirs.hidden).item(), fed
        fed += int(chunk.shape[0])
    long_row = rows[id(split)][2]
    assert long_row.private and not rows[id(split)][0].private
    assert split._shared.capacity <= 256 < shared._shared.capacity
    # The long row's store holds it alone: one slot, not four, at its length.
    assert split._private[long_row.slot].num_slots == 1
    assert split._private[long_row.slot].capacity == shared._shared.capacity == 512
    assert split.kv_nbytes < shared.kv_nbytes
    saved = [t.save_block(rows[id(t)][2], 200, 330) for t in (shared, split)]
    for name in ("keys", "values", "hidden"):
        assert mx.array_equal(getattr(saved[0], name), getattr(saved[1], name)).item()
    split.release(long_row)
    assert not split._private


@pytest.mark.parametrize("compiled", [True, False])
def test_a_lazy_trim_gives_the_bits_of_a_trim(model, compiled: bool) -> None:
    """A drafting row's next forward is built before its verdict is read: rows trimmed by a
    count still computing (beside a row that is not) write, attend and keep hidden states
    exactly as rows trimmed by the number."""
    outputs = []
    for lazy in (False, True):
        target = SlotTarget(model.target, max_rows=4, keep_hidden=True)
        if not compiled:
            target._compiled = None
        rows = _rows(target, [9, 30, 17])
        drafts = [
            mx.array([4, 5, 6], mx.int32),
            mx.array([8], mx.int32),
            mx.array([9, 7], mx.int32),
        ]
        verified = target.forward(rows, drafts)
        rejected = [2, 0, 1]
        for row, output, count in zip(rows, verified, rejected, strict=True):
            if lazy:  # a count that depends on the forward, as a verdict does
                fake = (output.logits[0, 0] * 0).astype(mx.int32) + count
                target.trim_lazily(row, fake)
            else:
                target.trim(row, count)
        step = target.forward(rows, [mx.array([3, 2], mx.int32)] * 3)
        if lazy:
            assert [target.settle(row) for row in rows] == rejected
        step += target.forward(rows, [mx.array([11], mx.int32)] * 3)
        mx.eval([(o.logits, o.hidden) for o in step], target.unevaluated())
        outputs.append((step, [row.length for row in rows], target.save_block(rows[1], 0, 33)))
    (eager, eager_lengths, eager_block), (lazy_out, lazy_lengths, lazy_block) = outputs
    assert eager_lengths == lazy_lengths == [13, 34, 21]
    for a, b in zip(eager, lazy_out, strict=True):
        assert mx.array_equal(a.logits, b.logits).item()
        assert mx.array_equal(a.hidden, b.hidden).item()
    assert mx.array_equal(eager_block.keys, lazy_block.keys).item()
    assert mx.array_equal(eager_block.hidden, lazy_block.hidden).item()


def _fed_by(target: SlotTarget, prompt: mx.array, chunks: list[int]):
    """A fresh row fed ``prompt`` in forwards of ``chunks`` tokens (their sum is its length):
    every position's logits [L, V] and hidden states [L, H], and the row's saved block (the
    KV of every layer and the hidden states, as the prefix cache stores them)."""
    row = target.new_row()
    logits, hidden, start = [], [], 0
    for size in chunks:
        (out,) = target.forward([row], [prompt[start : start + size]], "all")
        mx.eval(out.logits, out.hidden, target.unevaluated())
        logits.append(out.logits)
        hidden.append(out.hidden)
        start += size
    block = target.save_block(row, 0, row.length)
    target.release(row)
    return mx.concatenate(logits), mx.concatenate(hidden), block


def _assert_prefill_equals_decode(target: SlotTarget, prompt: mx.array, plans) -> None:
    """Token by token (decode steps) and every chunking in ``plans`` give the same bits:
    logits, hidden states, keys and values."""
    length = int(prompt.shape[0])
    want = _fed_by(target, prompt, [1] * length)
    for chunks in plans:
        got = _fed_by(target, prompt, chunks)
        assert mx.array_equal(got[0], want[0]).item(), chunks
        assert mx.array_equal(got[1], want[1]).item(), chunks
        for name in ("keys", "values", "hidden"):
            assert mx.array_equal(getattr(got[2], name), getattr(want[2], name)).item(), name


def test_prefill_in_any_chunking_gives_the_bits_of_decode_steps(model) -> None:
    """With the fused attention kernel, a prompt fed in one forward, in chunks of any size
    or token by token (as decode steps feed) writes the same KV and gives the same logits,
    bitwise: the prefix cache is exact and a prompt's first token does not depend on how it
    was chunked."""
    target = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    assert target.attention == "kernel"
    prompt = _prompt(3, 200)
    # The largest forward the target takes: 200 tokens at once on the quantized kernel; the
    # float products' BLAS kernel is batch-invariant up to 128 rows.
    largest = min(200, target.max_prefill_tokens)
    whole = [largest] * (200 // largest) + ([200 % largest] if 200 % largest else [])
    _assert_prefill_equals_decode(target, prompt, [whole, [7] * 28 + [4], [64, 64, 64, 8]])


def test_quantized_targets_with_the_kernel_prefill_hundreds_of_tokens_a_forward(model) -> None:
    """Every product on the quantized kernel and attention on the fused one: no row limit,
    so a prompt alone feeds hundreds of tokens a forward; float products keep the BLAS
    kernel's limit."""
    target = SlotTarget(model.target, max_rows=4)
    quantized = model.weights.startswith("affine")
    assert target.max_prefill_tokens == (384 if quantized else 128)
    assert SlotTarget(model.target, max_rows=4, attention="mlx").max_prefill_tokens == 128


@pytest.fixture(scope="module", params=["float32", "int8"])
def default_model(request: pytest.FixtureRequest):
    from mtplx.models.gguf import ensure_default_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPLX_ACTIVATIONS", request.param)
        yield load(ensure_default_model())


def test_the_default_model_prefills_with_the_bits_of_decode_steps(default_model) -> None:
    """The default model on its Q4_1 weights, with either activations mode: a prompt of 300
    tokens in one forward and in the engine's chunks gives the logits, hidden states and KV
    of 300 decode steps."""
    target = SlotTarget(default_model.target, max_rows=4, keep_hidden=True)
    assert target.attention == "kernel" and target.max_prefill_tokens == 384
    prompt = mx.array([(11 + 37 * j * j) % 20000 + 100 for j in range(300)], mx.int32)
    _assert_prefill_equals_decode(target, prompt, [[300], [32] * 9 + [12]])
