"""The fused attention kernel: agreement with a NumPy reference, and a token's result bitwise
independent of the other tokens of the call, their order, the chunking and the thread split."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx import attention, quant

pytestmark = pytest.mark.skipif(
    not attention.available(), reason="the kernel needs a C compiler and nanobind to build"
)

HEADS, KV, DIM, CAP, SLOTS = 9, 3, 64, 320, 4


def _store(seed: int, dim: int = DIM, cap: int = CAP) -> tuple[np.ndarray, np.ndarray]:
    """Keys [S, kv, cap, d] and values [S, kv, cap, d + 1] (the store's layout: a last
    feature the kernel does not read)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((SLOTS, KV, cap, dim)).astype(np.float32)
    values = rng.standard_normal((SLOTS, KV, cap, dim + 1)).astype(np.float32)
    return keys, values


def _queries(seed: int, n: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, HEADS, dim)).astype(np.float32)


def _attend(q, keys, values, slots, counts, scale: float) -> np.ndarray:
    out = attention.attend(
        mx.array(q),
        mx.array(keys),
        mx.array(values),
        mx.array(np.asarray(slots, np.int32)),
        mx.array(np.asarray(counts, np.int32)),
        scale,
    )
    return np.array(out).reshape(len(slots), HEADS, -1)


def _reference(q, keys, values, slots, counts, scale: float) -> np.ndarray:
    """Softmax attention in float64."""
    dim = q.shape[-1]
    out = np.zeros(q.shape, np.float64)
    for i, (slot, count) in enumerate(zip(slots, counts, strict=True)):
        for h in range(HEADS):
            g = h // (HEADS // KV)
            k = keys[slot, g, :count].astype(np.float64)
            v = values[slot, g, :count, :dim].astype(np.float64)
            s = (q[i, h].astype(np.float64) * scale) @ k.T
            p = np.exp(s - s.max())
            out[i, h] = p @ v / p.sum()
    return out


@pytest.mark.parametrize("dim", [64, 72, 5])
def test_the_kernel_agrees_with_a_numpy_reference(dim: int) -> None:
    keys, values = _store(0, dim)
    slots = [0, 1, 1, 2, 3, 3, 0]
    counts = [1, 2, 17, 64, 65, 300, CAP]
    q = _queries(1, len(slots), dim)
    scale = 1 / math.sqrt(dim)
    got = _attend(q, keys, values, slots, counts, scale)
    np.testing.assert_allclose(
        got, _reference(q, keys, values, slots, counts, scale), rtol=2e-5, atol=2e-6
    )


def test_the_vectorised_exp_is_close_to_exp() -> None:
    xs = np.concatenate([-np.logspace(-8, np.log10(86.0), 400), [0.0, -87.0]])
    got = np.array([attention.exp(float(x)) for x in xs], np.float64)
    want = np.exp(xs.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=4e-7)
    assert attention.exp(0.0) == 1.0


def test_a_token_gives_the_same_bits_alone_among_others_and_in_any_chunk() -> None:
    """A prompt of 300 tokens in slot 2: each token's result alone equals its result in one
    call of all 300, in chunks of 7, 64 and 128, and beside other slots' tokens, reordered."""
    keys, values = _store(3)
    q = _queries(4, 300)
    counts = list(range(1, 301))
    scale = 0.125
    whole = _attend(q, keys, values, [2] * 300, counts, scale)
    for token in (0, 1, 15, 16, 17, 63, 64, 127, 128, 299):
        alone = _attend(q[token : token + 1], keys, values, [2], [counts[token]], scale)
        assert np.array_equal(alone[0], whole[token]), token
    for chunk in (7, 64, 128):
        pieces = [
            _attend(
                q[s : s + chunk],
                keys,
                values,
                [2] * len(q[s : s + chunk]),
                counts[s : s + chunk],
                scale,
            )
            for s in range(0, 300, chunk)
        ]
        assert np.array_equal(np.concatenate(pieces), whole), chunk
    # Beside other slots' tokens (a verify and decode rows), in another order.
    others = _queries(5, 6)
    mixed_q = np.concatenate([others[:3], q[40:50], others[3:]])
    mixed_slots = [0, 1, 1] + [2] * 10 + [3, 3, 0]
    mixed_counts = [5, 200, 201, *counts[40:50], 9, 10, 320]
    mixed = _attend(mixed_q, keys, values, mixed_slots, mixed_counts, scale)
    assert np.array_equal(mixed[3:13], whole[40:50])


def test_keys_past_a_tokens_count_never_change_its_bits() -> None:
    """Whatever the store holds past a token's count (a longer row's KV, stale entries,
    NaN), its result is the same bits."""
    keys, values = _store(6)
    q = _queries(7, 3)
    counts = [1, 33, 100]
    before = _attend(q, keys, values, [1, 1, 1], counts, 0.125)
    keys[1, :, 100:] = np.nan
    values[1, :, 100:] = np.inf
    after = _attend(q, keys, values, [1, 1, 1], counts, 0.125)
    assert np.array_equal(before, after)


def _bits(a: np.ndarray) -> np.ndarray:
    """The float32 bits (np.array_equal would call -0.0 and 0.0 equal)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize(("heads", "kv"), [(9, 3), (5, 1), (16, 1), (4, 4), (8, 2)])
def test_a_prompts_tokens_give_their_bits_alone_in_any_block(heads: int, kv: int) -> None:
    """Consecutive tokens of one slot (a prompt chunk: the kernel gathers them in blocks that
    share each key and value load) against each token alone, bit for bit, for kv heads of
    1 to 16 query heads, blocks cut anywhere (chunks of 1 to 13 tokens)."""
    rng = np.random.default_rng(20 + heads)
    keys = rng.standard_normal((2, kv, 200, DIM)).astype(np.float32)
    values = rng.standard_normal((2, kv, 200, DIM + 1)).astype(np.float32)
    q = rng.standard_normal((60, heads, DIM)).astype(np.float32)
    counts = np.arange(60, dtype=np.int32) + 101

    def run(rows: slice) -> np.ndarray:
        out = attention.attend(
            mx.array(q[rows]),
            mx.array(keys),
            mx.array(values),
            mx.array(np.ones(len(counts[rows]), np.int32)),
            mx.array(counts[rows]),
            0.125,
        )
        return np.array(out).reshape(-1, heads, DIM)

    whole = run(slice(None))
    alone = np.concatenate([run(slice(i, i + 1)) for i in range(60)])
    assert np.array_equal(_bits(whole), _bits(alone))
    for chunk in (2, 5, 13):
        pieces = np.concatenate([run(slice(s, s + chunk)) for s in range(0, 60, chunk)])
        assert np.array_equal(_bits(pieces), _bits(whole)), chunk
    ref = np.zeros(whole.shape)
    for i in range(60):
        for h in range(heads):
            k = keys[1, h // (heads // kv), : counts[i]].astype(np.float64)
            v = values[1, h // (heads // kv), : counts[i], :DIM].astype(np.float64)
            s = (q[i, h].astype(np.float64) * 0.125) @ k.T
            p = np.exp(s - s.max())
            ref[i, h] = p @ v / p.sum()
    np.testing.assert_allclose(whole, ref, rtol=2e-5, atol=2e-6)


def test_a_token_never_reads_the_keys_of_later_tokens_in_its_block() -> None:
    """Tokens of one slot with counts 40 and 90 in one call (one block): what lies between
    (the later token's keys: here NaN keys, infinite values) never reaches the first token."""
    keys, values = _store(13)
    q = _queries(14, 2)
    alone = _attend(q[:1], keys, values, [2], [40], 0.125)
    keys[2, :, 40:90] = np.nan
    values[2, :, 40:90] = np.inf
    both = _attend(q, keys, values, [2, 2], [40, 90], 0.125)
    assert np.array_equal(_bits(both[0]), _bits(alone[0]))
    assert np.isnan(both[1]).all()


def test_the_thread_split_changes_no_bit() -> None:
    keys, values = _store(8)
    q = _queries(9, 256)
    slots = [i % SLOTS for i in range(256)]
    counts = [64 + i for i in range(256)]
    results = []
    before = attention.split_calls()
    try:
        for threads in (1, 2, 3, 5):
            attention.set_threads(threads)
            results.append(_attend(q, keys, values, slots, counts, 0.125))
    finally:
        attention.set_threads(0)
    assert attention.split_calls() > before  # the larger counts did split
    for other in results[1:]:
        assert np.array_equal(results[0], other)


def test_out_of_range_slots_and_counts_give_nan_and_bad_shapes_raise() -> None:
    """A slot or count past the store (a bug upstream) reads nothing and gives NaN: an error
    raised on MLX's worker thread would not reach the caller."""
    keys, values = _store(10)
    q = _queries(11, 1)
    for slots, counts in (([SLOTS], [1]), ([0], [0]), ([0], [CAP + 1]), ([-1], [3])):
        assert np.isnan(_attend(q, keys, values, slots, counts, 0.125)).all()
    with pytest.raises(ValueError):
        attention.attend(
            mx.array(q),
            mx.array(keys[..., :32]),
            mx.array(values),
            mx.zeros((1,), mx.int32),
            mx.ones((1,), mx.int32),
            0.125,
        )


_VARIANT_SCRIPT = """
import json
import mtplx
import mlx.core as mx, numpy as np
from mtplx import attention, quant
rng = np.random.default_rng(12)
out = {"variant": quant.quant_info().variant, "lanes": attention.lanes()}
for heads, kv, d, prompt in [(9, 3, 64, False), (8, 2, 72, False), (4, 4, 5, False),
                             (9, 3, 64, True), (5, 1, 128, True), (8, 2, 72, True)]:
    keys = rng.standard_normal((2, kv, 90, d)).astype(np.float32)
    values = rng.standard_normal((2, kv, 90, d + 1)).astype(np.float32)
    q = rng.standard_normal((40, heads, d)).astype(np.float32)
    # prompt: the 40 tokens of one slot in a row (blocks of consecutive tokens)
    slots = np.zeros(40, np.int64) + 1 if prompt else np.arange(40) % 2
    counts = np.arange(40) + 45 if prompt else np.arange(40) * 2 + 3
    args = lambda i: (mx.array(q[i]), mx.array(keys), mx.array(values),
                      mx.array(slots[i].astype(np.int32)), mx.array(counts[i].astype(np.int32)))
    y = np.array(attention.attend(*args(slice(None)), 0.2)).reshape(40, heads, d)
    alone = np.concatenate([np.array(attention.attend(*args(slice(i, i + 1)), 0.2))
                            for i in range(40)]).reshape(40, heads, d)
    ref = np.zeros((40, heads, d))
    for i in range(40):
        for h in range(heads):
            k = keys[slots[i], h // (heads // kv), :counts[i]].astype(np.float64)
            v = values[slots[i], h // (heads // kv), :counts[i], :d].astype(np.float64)
            s = (q[i, h].astype(np.float64) * 0.2) @ k.T
            p = np.exp(s - s.max())
            ref[i, h] = p @ v / p.sum()
    same = bool((y.view(np.uint32) == alone.view(np.uint32)).all())
    out[f"{heads}/{kv}/{d}/{prompt}"] = [same, float(np.abs(y - ref).max())]
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512"])
def test_each_variant_agrees_and_is_invariant(variant: str) -> None:
    """Each vector variant of the kernel (built with the quantized kernel), forced, in a
    fresh process; a variant this CPU cannot run is replaced by the portable one."""
    if variant not in quant.runnable_variants():
        variant = "portable"
    env = dict(os.environ, MTPLX_QUANT_VARIANT=variant)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _VARIANT_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.pop("variant") == variant
    assert result.pop("lanes") == (16 if variant == "avx512" else 8)
    for invariant, error in result.values():
        assert invariant
        assert error < 2e-6
