"""The slot target's forwards: a row's outputs do not depend on the other rows, bitwise,
agree with the model's own forward, and do not depend on how a prompt is chunked or on
whether a trim was lazy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import load
from mtplx.models.slot_target import SlotTarget
from tests.models.slots import fed_rows, prompt


def test_a_row_alone_and_among_others_gives_the_same_bits(model) -> None:
    target = SlotTarget(model.target, max_rows=16)
    lengths = [3 + 19 * i % 97 for i in range(16)]  # 16 rows of different lengths
    rows = fed_rows(target, lengths)
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
    rows = fed_rows(target, [9, 30, 4])
    outputs = target.forward(rows, [mx.array([3, 4], mx.int32)] * 3)
    for i, (row, output) in enumerate(zip(rows, outputs, strict=True)):
        assert row.length == [9, 30, 4][i] + 2
        cache = model.target.make_cache()
        history = mx.concatenate([prompt(i, [9, 30, 4][i]), mx.array([3, 4], mx.int32)])
        logits, _ = model.target(history[None], cache)
        np.testing.assert_allclose(
            np.array(output.logits), np.array(logits[0, -2:]), atol=1e-4, rtol=1e-4
        )


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
        rows = fed_rows(target, [9, 30, 17])
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
    tokens = prompt(3, 200)
    # The largest forward the target takes: 200 tokens at once on the quantized kernel; the
    # float products' BLAS kernel is batch-invariant up to 128 rows.
    largest = min(200, target.max_prefill_tokens)
    whole = [largest] * (200 // largest) + ([200 % largest] if 200 % largest else [])
    _assert_prefill_equals_decode(target, tokens, [whole, [7] * 28 + [4], [64, 64, 64, 8]])


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
