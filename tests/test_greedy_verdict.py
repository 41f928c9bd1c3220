"""The greedy verdict's kernel node (``fused_layer.greedy_verdict``) against the MLX ops it
replaces (``mlx_ops.mx_verify_greedy``): the same ints for every accepted-prefix length,
ties, infinities and NaNs (MLX's argmax: the first maximum, a NaN above all), one row given
as [k+1, V] / [k] or as a batch, and one graph node; ``speculative.verify`` serves its
greedy rows with it. The counts a queued drafting cycle takes from a verdict
(``fused_layer.verdict_counts``) against the MLX ops they replace."""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from mtplx import fused_layer
from mtplx.sampling.mlx_ops import mx_verify_greedy

pytestmark = pytest.mark.skipif(not fused_layer.available(), reason="no fused kernels here")


def _logits(rng: np.random.Generator, batch: int, n: int, vocab: int) -> np.ndarray:
    """Logits with every kind of argmax MLX can meet: ties (small integers), infinities and
    NaNs sprinkled in, whole rows of -inf."""
    logits = rng.integers(-3, 4, size=(batch, n, vocab)).astype(np.float32)
    logits += (rng.random((batch, n, vocab)) < 0.5) * rng.standard_normal((batch, n, vocab))
    special = rng.random((batch, n, vocab))
    logits[special < 0.002] = np.inf
    logits[(special >= 0.002) & (special < 0.004)] = -np.inf
    logits[(special >= 0.004) & (special < 0.006)] = np.nan
    logits[0, 0] = -np.inf
    return logits.astype(np.float32)


def _drafts(rng: np.random.Generator, logits: np.ndarray) -> np.ndarray:
    """Drafts that often equal MLX's argmax at their position (every prefix length occurs)."""
    batch, n, vocab = logits.shape
    greedy = np.array(mx.argmax(mx.array(logits), axis=-1))
    return np.where(
        rng.random((batch, n - 1)) < 0.75,
        greedy[:, : n - 1],
        rng.integers(0, vocab, size=(batch, n - 1)),
    ).astype(np.int32)


@pytest.mark.parametrize("vocab", [1, 7, 300, 49152])
@pytest.mark.parametrize("num_draft", [0, 1, 2, 5])
def test_verdict_is_mx_verify_greedy_bits(vocab: int, num_draft: int) -> None:
    rng = np.random.default_rng(vocab * 10 + num_draft)
    batch = 64 if vocab < 49152 else 24
    logits = _logits(rng, batch, num_draft + 1, vocab)
    drafts = _drafts(rng, logits)
    ref_accepted, ref_tokens = mx_verify_greedy(mx.array(logits), mx.array(drafts))
    accepted, tokens = fused_layer.greedy_verdict(mx.array(logits), mx.array(drafts))
    assert accepted.dtype == mx.int32 and tokens.dtype == mx.int32
    np.testing.assert_array_equal(np.array(accepted), np.array(ref_accepted))
    np.testing.assert_array_equal(np.array(tokens), np.array(ref_tokens))
    for b in range(batch):  # one row alone, as [k+1, V] and [k]: shapes [1], [1, k+1]
        one = fused_layer.greedy_verdict(mx.array(logits[b]), mx.array(drafts[b]))
        assert one[0].shape == (1,) and one[1].shape == (1, num_draft + 1)
        np.testing.assert_array_equal(np.array(one[0]), np.array(ref_accepted)[b : b + 1])
        np.testing.assert_array_equal(np.array(one[1]), np.array(ref_tokens)[b : b + 1])
    if num_draft and vocab > 1:
        counts = np.bincount(np.array(accepted), minlength=num_draft + 1)
        assert (counts > 0).all()  # every prefix length occurs


def test_verdict_reads_strided_and_other_typed_inputs() -> None:
    """A transposed / sliced view and float16 logits, uint32 drafts: MLX's conversions first."""
    rng = np.random.default_rng(3)
    logits = _logits(rng, 4, 3, 200)
    drafts = _drafts(rng, logits)
    view = mx.array(np.ascontiguousarray(logits.transpose(1, 0, 2))).transpose(1, 0, 2)
    for given, ds in (
        (view, mx.array(drafts)),
        (mx.array(logits).astype(mx.float16), mx.array(drafts).astype(mx.uint32)),
        (mx.array(logits)[:, :, ::2], mx.array(drafts) // 2),
    ):
        ref = mx_verify_greedy(given.astype(mx.float32), ds)
        got = fused_layer.greedy_verdict(given, ds)
        np.testing.assert_array_equal(np.array(got[0]), np.array(ref[0]))
        np.testing.assert_array_equal(np.array(got[1]), np.array(ref[1]))


def test_verdict_is_one_node() -> None:
    logits = mx.array(np.zeros((2, 49152), np.float32))
    drafts = mx.array(np.zeros((1,), np.int32))
    mx.eval(logits, drafts)
    out = io.StringIO()
    mx.export_to_dot(out, *fused_layer.greedy_verdict(logits, drafts))
    assert re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()) == [
        "MTPLXGreedyVerdict"
    ]


def test_verdict_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        fused_layer.greedy_verdict(mx.zeros((3, 10)), mx.zeros((3,), mx.int32))
    with pytest.raises(ValueError):
        fused_layer.greedy_verdict(mx.zeros((2, 3, 10)), mx.zeros((1, 2), mx.int32))
    with pytest.raises(ValueError):
        fused_layer.greedy_verdict(mx.zeros((10,)), mx.zeros((0,), mx.int32))


@pytest.mark.parametrize("num_draft", [0, 1, 2, 4])
def test_verdict_counts_are_mlx_ops_ints(num_draft: int) -> None:
    """Every accepted count of a [1, k+1] verdict: what ``queue_draft`` built with MLX's ops
    (a reshape, a subtraction, an addition, a take), and one node."""
    rng = np.random.default_rng(num_draft)
    for accepted in range(num_draft + 1):
        tokens = rng.integers(0, 49152, size=(1, num_draft + 1)).astype(np.int32)
        tokens[0, accepted + 1 :] = -1
        num_accepted, output_tokens = mx.array([accepted], mx.int32), mx.array(tokens)
        got = fused_layer.verdict_counts(num_accepted, output_tokens)
        scalar = num_accepted.reshape(())
        want = (
            num_draft - scalar,
            scalar + 1,
            output_tokens.reshape(-1),
            mx.take(output_tokens.reshape(-1), num_accepted),
        )
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == mx.int32 and g.shape == w.shape
            np.testing.assert_array_equal(np.array(g), np.array(w))
    out = io.StringIO()
    mx.export_to_dot(out, *fused_layer.verdict_counts(num_accepted, output_tokens))
    assert re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()) == [
        "MTPLXVerdictCounts"
    ]


@pytest.mark.parametrize("size", [1, 5, 300, 8192])
def test_greedy_draft_is_mlx_argmax_and_take(size: int) -> None:
    """``vocab[argmax(logits)]`` for ties, infinities, NaNs, [V'] or [1, 1, V'] logits."""
    rng = np.random.default_rng(size)
    logits = _logits(rng, 40, 1, size)[:, 0]
    vocab = rng.permutation(49152)[:size].astype(np.int32)
    ids = mx.array(vocab)
    for row in logits:
        for given in (mx.array(row), mx.array(row).reshape(1, 1, -1)):
            want = ids[mx.argmax(given.reshape(-1).astype(mx.float32))].astype(mx.int32)
            got = fused_layer.greedy_draft(given, ids)
            assert got.dtype == mx.int32 and got.shape == ()
            assert got.item() == want.item()
    out = io.StringIO()
    mx.export_to_dot(out, fused_layer.greedy_draft(mx.array(logits[0]), ids))
    assert re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()) == ["MTPLXGreedyDraft"]
