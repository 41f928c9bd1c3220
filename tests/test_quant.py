"""The batch-invariant quantized product (mtplx.quant): agreement with a NumPy reference for
every bit width and group size, bitwise invariance over row counts, thread counts and lazy
graphs (mx.compile), and every vector variant built from the same sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx import quant

KINDS = [(bits, group) for bits in (4, 8) for group in (32, 64, 128)]


def _weights(rng: np.random.Generator, n: int, k: int, bits: int, group: int, half: bool = False):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    if half:  # float16 scales and biases (GGUF's), read as they are
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    mx.eval(packed, scales, biases)
    return packed, scales, biases


def _reference(x: np.ndarray, packed, scales, biases, bits: int, group: int) -> np.ndarray:
    """float64 product with the weights unpacked by hand (no MLX dequantize)."""
    words = np.array(packed).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, None, :]
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    s = np.repeat(np.array(scales, dtype=np.float64), group, axis=1)
    b = np.repeat(np.array(biases, dtype=np.float64), group, axis=1)
    return x.astype(np.float64) @ (s * q + b).T


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_agrees_with_numpy_reference(bits: int, group: int, half: bool) -> None:
    rng = np.random.default_rng(bits * 1000 + group)
    packed, scales, biases = _weights(rng, 77, 384, bits, group, half)
    for rows in (1, 3, 4, 5, 17):
        x = rng.standard_normal((rows, 384)).astype(np.float32)
        y = np.array(quant.qmm(mx.array(x), packed, scales, biases, bits, group))
        expected = _reference(x, packed, scales, biases, bits, group)
        assert y.dtype == np.float32 and y.shape == (rows, 77)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_bitwise_invariant_over_row_counts(bits: int, group: int) -> None:
    """Each row's outputs are the same bits alone and among 1..130 other rows (the direct
    register path up to 4 rows, the unpacked panel beyond)."""
    rng = np.random.default_rng(7 + bits + group)
    packed, scales, biases = _weights(rng, 70, 256, bits, group, half=group == 64)
    x = rng.standard_normal((131, 256)).astype(np.float32)
    alone = np.concatenate(
        [np.array(quant.qmm(mx.array(x[i : i + 1]), packed, scales, biases, bits, group))
         for i in range(x.shape[0])]
    )  # fmt: skip
    for rows in (*range(2, 20), 31, 64, 96, 128, 131):
        for start in (0, x.shape[0] - rows):
            y = np.array(
                quant.qmm(mx.array(x[start : start + rows]), packed, scales, biases, bits, group)
            )
            np.testing.assert_array_equal(y, alone[start : start + rows])


def test_bitwise_invariant_over_thread_counts() -> None:
    """Columns split between threads (a product large enough to be split): same bits."""
    rng = np.random.default_rng(3)
    packed, scales, biases = _weights(rng, 1000, 512, 4, 32)
    x = mx.array(rng.standard_normal((9, 512)).astype(np.float32))
    ext = quant.load_extension()
    before = ext.threads()
    try:
        results = []
        for threads in (1, 2, 3, 4):
            quant.set_threads(threads)
            splits = ext.split_calls()
            for rows in (1, 4, 9):
                results.append(
                    (threads, rows, np.array(quant.qmm(x[:rows], packed, scales, biases, 4, 32)))
                )
            assert (ext.split_calls() > splits) == (threads > 1)
    finally:
        quant.set_threads(before)
    by_rows: dict[int, np.ndarray] = {}
    for _, rows, y in results:
        if rows in by_rows:
            np.testing.assert_array_equal(y, by_rows[rows])
        else:
            by_rows[rows] = y
    np.testing.assert_array_equal(by_rows[1], by_rows[9][:1])


def test_a_prompt_chunks_last_columns_in_halves_keep_the_bits() -> None:
    """Many rows over 9 column chunks (an o_proj of 576 columns): on 2 threads the last chunk
    goes in halves; every thread count gives the bits of one thread and of each row alone."""
    rng = np.random.default_rng(5)
    packed, scales, biases = _weights(rng, 576, 256, 4, 32)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    ext = quant.load_extension()
    before = ext.threads()
    try:
        results = []
        for threads in (1, 2, 3, 4):
            quant.set_threads(threads)
            results.append(np.array(quant.qmm(mx.array(x), packed, scales, biases, 4, 32)))
            results.append(_int8(x, packed, scales, biases, 4, 32))
        quant.set_threads(1)
        alone = np.concatenate(
            [np.array(quant.qmm(mx.array(x[i : i + 1]), packed, scales, biases, 4, 32))
             for i in range(40)]
        )  # fmt: skip
    finally:
        quant.set_threads(before)
    for y in results[2::2]:
        np.testing.assert_array_equal(y, results[0])
    for y in results[3::2]:
        np.testing.assert_array_equal(y, results[1])
    np.testing.assert_array_equal(results[0], alone)


def test_lazy_graph_compile_and_leading_dims() -> None:
    """The product is an MLX primitive: it composes with other ops and mx.compile, takes
    leading batch dimensions and non-contiguous inputs, and gives the same bits."""
    rng = np.random.default_rng(5)
    packed, scales, biases = _weights(rng, 48, 128, 8, 64)
    x = mx.array(rng.standard_normal((2, 3, 128)).astype(np.float32))
    direct = quant.qmm(x, packed, scales, biases, 8, 64)
    assert direct.shape == (2, 3, 48)

    @mx.compile
    def fused(x: mx.array, w: mx.array, s: mx.array, b: mx.array) -> mx.array:
        return mx.exp(quant.qmm(x * 1.0, w, s, b, 8, 64) * 0.0) * quant.qmm(x, w, s, b, 8, 64)

    np.testing.assert_array_equal(np.array(fused(x, packed, scales, biases)), np.array(direct))
    transposed = mx.array(np.array(x).transpose(1, 0, 2).copy()).transpose(1, 0, 2)
    np.testing.assert_array_equal(
        np.array(quant.qmm(transposed, packed, scales, biases, 8, 64)), np.array(direct)
    )
    # async_eval: queued, then read.
    y = quant.qmm(x, packed, scales, biases, 8, 64)
    mx.async_eval(y)
    np.testing.assert_array_equal(np.array(y), np.array(direct))


def test_bad_arguments_are_refused() -> None:
    rng = np.random.default_rng(1)
    packed, scales, biases = _weights(rng, 8, 64, 4, 32)
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="bits"):
        quant.qmm(x, packed, scales, biases, 3, 32)
    with pytest.raises(ValueError, match="group_size"):
        quant.qmm(x, packed, scales, biases, 4, 16)
    with pytest.raises(ValueError, match="shapes"):
        quant.qmm(mx.zeros((1, 32)), packed, scales, biases, 4, 32)


def test_variant_follows_cpu_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTPLX_QUANT_VARIANT", raising=False)
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"})
    assert quant.kernel_variant(avx512, "x86_64") == "avx512"
    assert quant.kernel_variant(avx512 | {"avx512_vnni"}, "x86_64") == "avx512vnni"
    assert quant.kernel_variant(frozenset({"avx2", "fma", "f16c"}), "x86_64") == "avx2"
    assert quant.kernel_variant(frozenset({"avx2"}), "x86_64") == "portable"
    assert quant.kernel_variant(avx512, "aarch64") == "portable"
    monkeypatch.setenv("MTPLX_QUANT_VARIANT", "nope")
    with pytest.raises(quant.Unavailable, match="MTPLX_QUANT_VARIANT"):
        quant.kernel_variant()


# The integer-dot mode's cases in every variant: (bits, group, groups a row); 8-bit rows of
# 18 groups of 32 (the default model's LM head, 576) sum two whole unit blocks, then a term.
INT8_CASES = [(4, 32, 5), (4, 128, 5), (8, 32, 5), (8, 64, 5), (8, 32, 18)]

_VARIANT_SCRIPT = (
    f"INT8_CASES = {INT8_CASES!r}\n"
    + """
import json, sys
import mtplx
import mlx.core as mx, numpy as np
from mtplx import quant
rng = np.random.default_rng(11)
out = {"variant": quant.quant_info().variant}
for bits, group in [(4, 32), (8, 128)]:
    w = mx.array(rng.standard_normal((40, 256)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    if bits == 4:
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    y = np.array(quant.qmm(mx.array(x), packed, scales, biases, bits, group))
    alone = np.concatenate([np.array(quant.qmm(mx.array(x[i:i+1]), packed, scales, biases,
                            bits, group)) for i in range(7)])
    ref = x.astype(np.float64) @ np.array(mx.dequantize(packed, scales.astype(mx.float32),
        biases.astype(mx.float32), group_size=group, bits=bits)).astype(np.float64).T
    out[f"{bits}/{group}"] = [bool((y == alone).all()),
                              float(np.abs(y - ref).max() / np.abs(ref).max())]
# The integer-dot mode: its bytes, for the test to compare with its NumPy twin.
for bits, group, groups in INT8_CASES:
    w = mx.array(rng.standard_normal((37, groups * group)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = rng.standard_normal((6, groups * group)).astype(np.float32)
    y = np.array(quant.qmm(mx.array(x), packed, scales, biases, bits, group, "int8"))
    out[f"int8 {bits}/{group}/{groups}"] = y.tobytes().hex()
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512", "avx512vnni"])
def test_each_variant_builds_agrees_and_is_invariant(variant: str) -> None:
    """Each variant, forced, in a fresh process (the build is cached). A variant whose
    instructions this CPU cannot execute is replaced by the portable one, which every CPU
    runs; the others are covered on the CPUs that have them."""
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
    # The integer-dot mode: the same bits in every variant, those of the NumPy twin (the same
    # generator draws, in the same order, as the script's).
    rng = np.random.default_rng(11)
    for _ in range(2):  # the draws of the script's float-mode checks
        rng.standard_normal((40, 256)), rng.standard_normal((7, 256))
    for bits, group, groups in INT8_CASES:
        w = mx.array(rng.standard_normal((37, groups * group)).astype(np.float32))
        packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        x = rng.standard_normal((6, groups * group)).astype(np.float32)
        twin = _int8_reference(x, packed, scales, biases, bits, group)
        key = f"int8 {bits}/{group}/{groups}"
        got = np.frombuffer(bytes.fromhex(result.pop(key)), np.float32)
        np.testing.assert_array_equal(got.reshape(twin.shape), twin)
    for invariant, error in result.values():
        assert invariant
        assert error < 1e-5


# -- the integer-dot mode ------------------------------------------------------------------


def _unpacked(packed, bits: int) -> np.ndarray:
    """q [N, K] (int64) from MLX's packed uint32 words."""
    words = np.array(packed).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, None, :]
    q = (words[..., None] >> shifts) & np.uint64((1 << bits) - 1)
    return q.reshape(words.shape[0], -1).astype(np.int64)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma(a, b, c) in float32, rounded once, as the C kernel's fmaf / vfmadd: a * b exact in
    float64 (both operands carry at most 24 significant bits), the sum with its exact error
    (TwoSum), and the float32 rounding corrected where the float64 sum sits exactly on a
    float32 midpoint and the error decides the side."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)
        c64 = c.astype(np.float64)
        s = p + c64
        bv = s - p
        e = (p - (s - bv)) + (c64 - bv)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        toward = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
        midpoint = (s != r64) & (s == (r64 + toward.astype(np.float64)) / 2) & (e != 0)
        # On a midpoint the exact sum s + e lies on e's side of it.
        fix = midpoint & ((e > 0) == (toward > r))
    return np.where(fix, toward, r).astype(np.float32)


def _int8_reference(x: np.ndarray, packed, scales, biases, bits: int, group: int) -> np.ndarray:
    """The integer-dot product in NumPy, step for step as quant_kernel.c defines it: rows
    quantized per group (d = max|x| / 127, x8 = rint(x / d), an all-zero group d = 0), then
    16 float32 lanes per element: 8-bit weights' whole blocks of 256 elements first, lane L
    of a block the exact integer sum of unit 4 (L % 4) + L // 4 (16 consecutive elements);
    then terms of E = 128 (4-bit) / 64 (8-bit) elements, lane L of a term the exact integer
    sum over its E / 16 consecutive elements, acc = fma(scale * d, P, acc) block by block
    and term by term, then acc = fma(bias, d * S, acc) 16 groups at a time, and the lanes
    summed in the fixed tree."""
    q = _unpacked(packed, bits)  # [N, K]
    s = np.array(scales.astype(mx.float32))  # [N, G] float32
    b = np.array(biases.astype(mx.float32))
    x = np.asarray(x, dtype=np.float32)
    m = x.shape[0]
    n, g_count = s.shape
    k = g_count * group
    xg = x.reshape(m, g_count, group)
    finite = np.isfinite(xg).all(axis=2)
    safe = np.where(np.isfinite(xg), xg, np.float32(0))
    d = np.abs(safe).max(axis=2) / np.float32(127)  # [M, G] float32
    live = (d > 0) & finite
    with np.errstate(invalid="ignore"):
        x8 = np.rint(safe / np.where(live, d, np.float32(1))[..., None])
    x8 = np.where(live[..., None], np.clip(x8, -127, 127), 0).astype(np.int64)
    d = np.where(live, d, np.float32(0)).astype(np.float32)
    d = np.where(finite, d, np.float32(np.nan)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        xs = d * x8.sum(axis=2).astype(np.float32)  # [M, G] float32: d * S, one rounding
    # The terms: [M | N, T, 16 lanes, E / 16 elements], zero past K.
    e = 128 if bits == 4 else 64
    t_count = -(-k // e)
    per = e // 16
    x8p = np.zeros((m, t_count * e), np.int64)
    x8p[:, :k] = x8.reshape(m, k)
    qp = np.zeros((n, t_count * e), np.int64)
    qp[:, :k] = q
    lanes = np.einsum(
        "mtli,ntli->mntl",
        x8p.reshape(m, t_count, 16, per),
        qp.reshape(n, t_count, 16, per),
    ).astype(np.float32)  # [M, N, T, 16] exact: |P| < 2^24
    g_of = (np.arange(t_count)[:, None] * e + np.arange(16)[None, :] * per) // group  # [T, 16]
    valid = g_of < g_count
    g_safe = np.where(valid, g_of, 0)
    dx = np.where(valid[None], d[:, g_safe], np.float32(0)).astype(np.float32)  # [M, T, 16]
    sc = np.where(valid[None], s[:, g_safe], np.float32(0)).astype(np.float32)  # [N, T, 16]
    acc = np.zeros((m, n, 16), np.float32)
    # 8-bit weights: first the whole blocks of 16 units (16 weight bytes, 16 elements, inside
    # one group), one lane a unit: lane L of block c takes unit 16 c + 4 (L % 4) + L // 4,
    # its exact integer sum; the terms after them as above.
    nb = k // 256 if bits == 8 else 0
    if nb:
        upg = group // 16
        sums = np.einsum(
            "mue,nue->mnu",
            x8[..., : nb * 256 // group, :].reshape(m, nb * 16, 16),
            q[:, : nb * 256].reshape(n, nb * 16, 16),
        ).astype(np.float32)  # [M, N, 16 NB] exact
        lane_unit = np.array([4 * (lane % 4) + lane // 4 for lane in range(16)])
        with np.errstate(invalid="ignore"):
            for c in range(nb):
                units = 16 * c + lane_unit
                dd = s[None, :, units // upg] * d[:, None, units // upg]  # [M, N, 16] rounded
                acc = _fma32(dd, sums[:, :, units], acc)
    with np.errstate(invalid="ignore"):
        for t in range(4 * nb, t_count):
            dd = sc[None, :, t, :] * dx[:, None, t, :]  # [M, N, 16] float32, rounded
            acc = _fma32(dd, lanes[:, :, t, :], acc)
        gb = -(-g_count // 16) * 16
        xs_p = np.zeros((m, gb), np.float32)
        xs_p[:, :g_count] = xs
        b_p = np.zeros((n, gb), np.float32)
        b_p[:, :g_count] = b
        for c in range(gb // 16):
            chunk = slice(16 * c, 16 * c + 16)
            acc = _fma32(
                np.broadcast_to(b_p[None, :, chunk], acc.shape),
                np.broadcast_to(xs_p[:, None, chunk], acc.shape),
                acc,
            )
        h = acc[..., :8] + acc[..., 8:]
        r = h[..., :4] + h[..., 4:]
        return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


def test_fma_twin_rounds_once() -> None:
    """The twin's float32 fma against cases where a product-then-sum or a float64 fma
    rounded to float32 (double rounding) would differ."""
    one = np.float32(1)
    eps = np.float32(2.0**-23)
    # (1 + eps) * (1 - eps) = 1 - eps^2: rounded once it is just below 1 ...
    a = np.array([one + eps], np.float32)
    b = np.array([one - eps], np.float32)
    c = np.array([-1.0], np.float32)
    assert _fma32(a, b, c)[0] == np.float32(-(2.0**-46))
    # ... and a sum whose float64 rounding lands on a float32 midpoint (1 + 3 * 2^-24),
    # whose tie-to-even would go up, while the exact sum lies just below it.
    a = np.array([np.float32(2.0**-24) * (one + eps)], np.float32)
    b = np.array([one - eps], np.float32)  # a * b = 2^-24 - 2^-70
    c = np.array([one + eps], np.float32)
    assert (c.astype(np.float64) + a.astype(np.float64) * b)[0] == 1 + 3 * 2.0**-24
    assert _fma32(a, b, c)[0] == one + eps
    assert _fma32(a, -b, -c)[0] == -(one + eps)
    # NaN and infinities pass through.
    assert np.isnan(_fma32(np.array([np.nan], np.float32), b, c)[0])
    assert _fma32(a, b, np.array([np.inf], np.float32))[0] == np.inf


def _int8(x: np.ndarray, packed, scales, biases, bits: int, group: int) -> np.ndarray:
    return np.array(quant.qmm(mx.array(x), packed, scales, biases, bits, group, "int8"))


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_int8_mode_equals_its_numpy_twin_bitwise(bits: int, group: int, half: bool) -> None:
    """Every kind, float32 and float16 scales, K a whole number of 4-group blocks or not,
    column counts that are not multiples of the kernel's 4-column tiles."""
    rng = np.random.default_rng(bits * 100 + group + half)
    for k in (4 * group, 5 * group, 7 * group, 384 if 384 % group == 0 else 256):
        packed, scales, biases = _weights(rng, 77, k, bits, group, half)
        for rows in (1, 3, 4, 5, 17):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            y = _int8(x, packed, scales, biases, bits, group)
            assert y.dtype == np.float32 and y.shape == (rows, 77)
            np.testing.assert_array_equal(
                y, _int8_reference(x, packed, scales, biases, bits, group)
            )


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 128)])
def test_int8_mode_edge_rows_equal_the_twin(bits: int, group: int) -> None:
    """Rounding ties, all-zero groups (d = 0), a group of one nonzero value, tiny and large
    magnitudes, negative zeros: the same bits as the twin."""
    rng = np.random.default_rng(5)
    k = 6 * group
    packed, scales, biases = _weights(rng, 9, k, bits, group, half=True)
    rows = np.zeros((6, k), np.float32)
    rows[0, :group] = 127.0 * np.arange(group) / 2  # x / d lands on .5 ties
    rows[0, group : 2 * group] = np.linspace(-127, 127, group)
    rows[1, 3 * group] = -3.0  # one value in an otherwise zero row
    rows[2] = rng.standard_normal(k).astype(np.float32) * 1e-30
    rows[3] = rng.standard_normal(k).astype(np.float32) * 1e20
    rows[4] = -0.0
    rows[5] = rng.standard_normal(k).astype(np.float32)
    rows[5, group : 3 * group] = 0.0
    y = _int8(rows, packed, scales, biases, bits, group)
    np.testing.assert_array_equal(y, _int8_reference(rows, packed, scales, biases, bits, group))
    assert (y[4] == 0).all() and np.isfinite(y).all()
    # A NaN or an infinity reaches every output of its row as NaN, as in a float product.
    rows[1, 5] = np.nan
    rows[2, 2 * group + 1] = np.inf
    y = _int8(rows, packed, scales, biases, bits, group)
    np.testing.assert_array_equal(y, _int8_reference(rows, packed, scales, biases, bits, group))
    assert np.isnan(y[1:3]).all() and np.isfinite(np.delete(y, [1, 2], axis=0)).all()


def test_int8_mode_is_close_to_the_float_product() -> None:
    """8-bit rows move a product by well under 1% of its scale (the quantization's
    size), for both weight widths."""
    rng = np.random.default_rng(9)
    for bits in (4, 8):
        packed, scales, biases = _weights(rng, 200, 576, bits, 32, half=True)
        x = rng.standard_normal((8, 576)).astype(np.float32)
        exact = _reference(x, packed, scales, biases, bits, 32)
        y = _int8(x, packed, scales, biases, bits, 32)
        assert 0 < np.abs(y - exact).max() < 0.01 * np.abs(exact).max()


@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_int8_mode_is_invariant_over_row_counts(bits: int, group: int) -> None:
    rng = np.random.default_rng(17 + bits + group)
    packed, scales, biases = _weights(rng, 70, 384 if 384 % group == 0 else 256, bits, group)
    x = rng.standard_normal((131, packed.shape[1] * 32 // bits)).astype(np.float32)
    alone = np.concatenate(
        [_int8(x[i : i + 1], packed, scales, biases, bits, group) for i in range(131)]
    )
    for rows in (2, 3, 4, 5, 9, 16, 31, 64, 131):
        for start in (0, x.shape[0] - rows):
            y = _int8(x[start : start + rows], packed, scales, biases, bits, group)
            np.testing.assert_array_equal(y, alone[start : start + rows])


def test_int8_mode_is_invariant_over_thread_counts() -> None:
    rng = np.random.default_rng(4)
    packed, scales, biases = _weights(rng, 1000, 512, 8, 64, half=True)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    ext = quant.load_extension()
    before = ext.threads()
    try:
        results = []
        for threads in (1, 2, 3):
            quant.set_threads(threads)
            splits = ext.split_calls()
            results.append(_int8(x, packed, scales, biases, 8, 64))
            assert ext.split_calls() > splits or threads == 1
    finally:
        quant.set_threads(before)
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])
    np.testing.assert_array_equal(results[0], _int8_reference(x, packed, scales, biases, 8, 64))


@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 576), (4, 64, 320), (8, 32, 96)])
def test_int8_mode_partial_last_term_over_rows_and_threads(bits: int, group: int, k: int) -> None:
    """K not a whole number of terms (the default model's 576 is 4.5 terms of 128): the
    padded lanes add nothing, alone, in every row tile and in every thread split."""
    rng = np.random.default_rng(k + bits)
    packed, scales, biases = _weights(rng, 301, k, bits, group, half=True)
    x = rng.standard_normal((13, k)).astype(np.float32)
    twin = _int8_reference(x, packed, scales, biases, bits, group)
    ext = quant.load_extension()
    before = ext.threads()
    try:
        for threads in (1, 2):
            quant.set_threads(threads)
            np.testing.assert_array_equal(_int8(x, packed, scales, biases, bits, group), twin)
            for i in range(13):
                np.testing.assert_array_equal(
                    _int8(x[i : i + 1], packed, scales, biases, bits, group), twin[i : i + 1]
                )
    finally:
        quant.set_threads(before)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 576), (4, 64, 1536), (8, 32, 576)])
def test_int8_mode_many_row_tiles_equal_the_twin(bits: int, group: int, k: int, half: bool) -> None:
    """A prompt chunk's rows (more than a few-row tile's) take tiles of their own shape: row
    counts of whole tiles and of whole tiles plus 1..5 rows, 67 columns (whole tiles and an
    odd column), on 1 and 2 threads, with the many-row tiles and without. The twin's bits
    every time, and each row alone gives its bits among the others."""
    rng = np.random.default_rng(bits * 10 + group + k + half)
    packed, scales, biases = _weights(rng, 67, k, bits, group, half)
    x = rng.standard_normal((41, k)).astype(np.float32)
    twin = _int8_reference(x, packed, scales, biases, bits, group)
    ext = quant.load_extension()
    before = ext.threads()
    try:
        for threads in (1, 2):
            quant.set_threads(threads)
            for many in (True, False):
                ext.set_many_rows_tiles(many)
                for rows in (7, 12, 13, 17, 36, 41):
                    np.testing.assert_array_equal(
                        _int8(x[:rows], packed, scales, biases, bits, group), twin[:rows]
                    )
        for i in (0, 6, 40):
            np.testing.assert_array_equal(
                _int8(x[i : i + 1], packed, scales, biases, bits, group), twin[i : i + 1]
            )
    finally:
        ext.set_many_rows_tiles(True)
        quant.set_threads(before)


@pytest.mark.parametrize(("bits", "n"), [(8, 4005), (4, 589)])
def test_int8_mode_few_rows_split_from_both_ends(bits: int, n: int) -> None:
    """A product of up to 4 rows is split with the calling thread taking column chunks from
    the front and helpers from the back, walking theirs downwards; an LM-head-sized weight
    (8-bit, over 2 MB) also prefetches differently. Column counts leave a partial last chunk
    and a partial last tile: every thread count gives the twin's bits."""
    rng = np.random.default_rng(n)
    packed, scales, biases = _weights(rng, n, 576, bits, 32, half=True)
    ext = quant.load_extension()
    before = ext.threads()
    try:
        for threads in (1, 2, 3):
            quant.set_threads(threads)
            # New rows each time: an output buffer MLX recycles holds another call's values.
            x = rng.standard_normal((4, 576)).astype(np.float32)
            twin = _int8_reference(x, packed, scales, biases, bits, 32)
            for rows in (1, 2, 3, 4):
                splits = ext.split_calls()
                y = _int8(x[:rows], packed, scales, biases, bits, 32)
                assert ext.split_calls() > splits or threads == 1
                np.testing.assert_array_equal(y, twin[:rows])
    finally:
        quant.set_threads(before)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_int8_mode_scales_blocks_of_16_groups_equal_the_twin(
    bits: int, group: int, half: bool
) -> None:
    """A 1-row tile converts its columns' scales 16 groups at a time (where a term spans 2
    or 4 groups) and picks each term's lanes out of them: rows of exactly one block, one
    group more, a partial last term inside the second block (18 and 33 groups), three whole
    blocks; 23 columns (whole tiles and odd columns); float32 and float16 parameters. The
    same bits as the twin, and as the 2- and 3-row tiles that read the scales term by term."""
    rng = np.random.default_rng(bits * 1000 + group + half)
    for groups in (16, 17, 18, 33, 48):
        k = groups * group
        packed, scales, biases = _weights(rng, 23, k, bits, group, half)
        x = rng.standard_normal((3, k)).astype(np.float32)
        twin = _int8_reference(x, packed, scales, biases, bits, group)
        np.testing.assert_array_equal(_int8(x, packed, scales, biases, bits, group), twin)
        for rows in (1, 2):
            np.testing.assert_array_equal(
                _int8(x[:rows], packed, scales, biases, bits, group), twin[:rows]
            )


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group"), KINDS)
def test_int8_mode_two_row_tiles_equal_the_twin(bits: int, group: int, half: bool) -> None:
    """Two rows (a depth-1 verify) take their own tile width (4 columns for 4-bit weights,
    3 for 8-bit): column counts around both widths' multiples (whole tiles, then 1-3 odd
    columns), K with and without a partial last term. Both rows the twin's bits, and each
    the same as that row alone."""
    rng = np.random.default_rng(bits * 10 + group + 2 * half)
    for k in (4 * group, 5 * group, 9 * group):
        for n in (1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15):
            packed, scales, biases = _weights(rng, n, k, bits, group, half)
            x = rng.standard_normal((2, k)).astype(np.float32)
            y = _int8(x, packed, scales, biases, bits, group)
            np.testing.assert_array_equal(
                y, _int8_reference(x, packed, scales, biases, bits, group)
            )
            for r in (0, 1):
                np.testing.assert_array_equal(
                    y[r : r + 1], _int8(x[r : r + 1], packed, scales, biases, bits, group)
                )


def test_int8_mode_rows_past_the_kept_scratch() -> None:
    """A call whose quantized rows outgrow the per-thread scratch a decode step reuses (a
    prompt chunk: allocated for the call) and single rows before and after it on the same
    thread: every row the twin's bits."""
    rng = np.random.default_rng(21)
    packed, scales, biases = _weights(rng, 9, 1536, 4, 32, half=True)
    x = rng.standard_normal((720, 1536)).astype(np.float32)  # ~1.1 MB of 8-bit rows
    twin = _int8_reference(x, packed, scales, biases, 4, 32)
    np.testing.assert_array_equal(_int8(x[:1], packed, scales, biases, 4, 32), twin[:1])
    np.testing.assert_array_equal(_int8(x, packed, scales, biases, 4, 32), twin)
    np.testing.assert_array_equal(_int8(x[5:7], packed, scales, biases, 4, 32), twin[5:7])


def test_int8_mode_in_lazy_graphs_and_bad_modes() -> None:
    rng = np.random.default_rng(6)
    packed, scales, biases = _weights(rng, 40, 256, 4, 64)
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    direct = quant.qmm(x, packed, scales, biases, 4, 64, "int8")
    compiled = mx.compile(lambda a: quant.qmm(a, packed, scales, biases, 4, 64, "int8"))
    np.testing.assert_array_equal(np.array(compiled(x)), np.array(direct))
    floats = quant.qmm(x, packed, scales, biases, 4, 64)
    assert not mx.array_equal(floats, direct).item()  # the mode reaches the kernel
    with pytest.raises(ValueError, match="activations"):
        quant.qmm(x, packed, scales, biases, 4, 64, "int4")


def _embed_twin(ids: np.ndarray, packed, scales, biases, bits: int, group: int) -> np.ndarray:
    """NumPy twin of ``embed_rows``: the rows unpacked by hand, ``scale * q`` rounded to
    float32, then ``+ bias`` rounded (two roundings, as mx.dequantize's multiply and add)."""
    words = np.array(packed)[ids.reshape(-1)].astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, None, :]
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    s = np.repeat(np.array(scales.astype(mx.float32))[ids.reshape(-1)], group, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32))[ids.reshape(-1)], group, axis=1)
    out = (s * q.astype(np.float32)).astype(np.float32) + b
    return out.astype(np.float32).reshape(*ids.shape, -1)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("bits", "group"), [(2, 32), *KINDS])
def test_embed_rows_are_mx_dequantize_bitwise(bits: int, group: int, half: bool) -> None:
    """The fused embedding lookup gives mx.dequantize's bits on the gathered rows (the path it
    replaces) and its NumPy twin's, for leading dimensions and repeated ids."""
    rng = np.random.default_rng(bits * 100 + group)
    packed, scales, biases = _weights(rng, 300, 384, bits, group, half)
    ids = rng.integers(0, 300, size=(3, 7)).astype(np.int32)
    ids[0, :2] = [299, 299]
    got = quant.embed_rows(mx.array(ids), packed, scales, biases, bits, group)
    want = quant.dequantize_rows(mx.array(ids), packed, scales, biases, bits, group)
    assert got.shape == want.shape == (3, 7, 384) and got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    twin = _embed_twin(ids, packed, scales, biases, bits, group)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), twin.view(np.uint32))


def test_embed_rows_is_one_node_in_lazy_and_compiled_graphs(tmp_path: Path) -> None:
    """One graph node whatever the ids' shape, the same bits under mx.compile and with lazy
    ids; an id outside the table gives a NaN row; mismatched shapes are refused."""
    rng = np.random.default_rng(3)
    packed, scales, biases = _weights(rng, 50, 128, 8, 32, half=True)
    ids = mx.array([[4, 9, 49]], mx.int32) + mx.zeros((1, 3), mx.int32)  # lazy
    lazy = quant.embed_rows(ids, packed, scales, biases, 8, 32)
    mx.export_to_dot(str(tmp_path / "g.dot"), lazy)
    assert (tmp_path / "g.dot").read_text().count("MTPLXEmbedRows") == 1
    compiled = mx.compile(lambda i: quant.embed_rows(i, packed, scales, biases, 8, 32) * 1.0)
    np.testing.assert_array_equal(np.array(compiled(ids)), np.array(lazy))
    bad = np.array(quant.embed_rows(mx.array([1, 50, -1], mx.int32), packed, scales, biases, 8, 32))
    assert np.isnan(bad[1:]).all() and not np.isnan(bad[0]).any()
    with pytest.raises(ValueError):
        quant.embed_rows(mx.array([1], mx.int32), packed, scales[:, :2], biases[:, :2], 8, 32)
    with pytest.raises(ValueError):
        quant.embed_rows(mx.array([1], mx.int32), packed, scales, biases, 3, 32)
