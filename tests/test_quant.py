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
    assert quant.kernel_variant(frozenset({"avx2", "fma", "f16c"}), "x86_64") == "avx2"
    assert quant.kernel_variant(frozenset({"avx2"}), "x86_64") == "portable"
    assert quant.kernel_variant(avx512, "aarch64") == "portable"
    monkeypatch.setenv("MTPLX_QUANT_VARIANT", "nope")
    with pytest.raises(quant.Unavailable, match="MTPLX_QUANT_VARIANT"):
        quant.kernel_variant()


_VARIANT_SCRIPT = """
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
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512"])
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
    for invariant, error in result.values():
        assert invariant
        assert error < 1e-5
