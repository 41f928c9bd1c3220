"""mtplx.blas_shim: the invariant kernel computes exactly the documented fixed order (compared
bitwise with a plain C reference), in the shim that is loaded and in a baseline build, and
the shim is compiled with flags chosen from the CPU's features, which key its cache."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mtplx import blas_shim
from mtplx.blas import INVARIANT_MAX_ROWS, blas_info, set_blas_threads
from tests.test_blas import FAST_PATH_EXPECTED, ROW_COUNTS, needs_fast

REFERENCE = Path(__file__).with_name("fixtures") / "sgemm_fixed_order.c"
KERNEL = Path(blas_shim.__file__).with_name("blas_invariant.c")
FLOAT_P = ctypes.POINTER(ctypes.c_float)
# K across the chunk of 16 (below, at, tails), the kernel's K blocks (768) and real widths.
DEPTHS = (1, 7, 15, 16, 17, 33, 100, 576, 769, 1553)
# N across the column tile (3) and the panel (84 columns at K = 576, 96 at most).
WIDTHS = (1, 2, 3, 4, 5, 49, 83, 84, 85, 97, 259)


def _compile(tmp: Path, name: str, sources: list[Path], flags: tuple[str, ...]) -> ctypes.CDLL:
    out = tmp / f"{name}.so"
    cmd = [
        blas_shim.find_compiler(),
        "-shared",
        "-fPIC",
        *flags,
        "-o",
        str(out),
        *map(str, sources),
    ]
    subprocess.run([*cmd, "-lm"], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    # -O1, not -O0, for speed; -ffp-contract=off keeps each operation rounded on its own.
    flags = ("-O1", "-ffp-contract=off")
    return _compile(tmp_path_factory.mktemp("reference"), "reference", [REFERENCE], flags)


def _stored(
    rng: np.random.Generator, rows: int, cols: int, transposed: bool, row_major: bool, pad: int
) -> tuple[np.ndarray, int]:
    """A random op(X) of rows x cols, as BLAS reads X: (array, padded leading dimension)."""
    outer, inner = (cols, rows) if transposed else (rows, cols)
    if not row_major:
        outer, inner = inner, outer
    return rng.standard_normal((outer, inner + pad)).astype(np.float32), inner + pad


def _cases(seed: int) -> list[dict]:
    """One product per (row count, depth), with a width, layout and scaling drawn at random."""
    rng = np.random.default_rng(seed)
    cases = []
    for i, (m, k) in enumerate((m, k) for m in ROW_COUNTS for k in DEPTHS):
        n = WIDTHS[i % len(WIDTHS)]
        row_major, trans_a, trans_b = (bool(b) for b in rng.integers(0, 2, 3))
        pad = int(rng.integers(0, 3))  # leading dimensions beyond the minimum
        alpha, beta = [(1.0, 0.0), (0.5, 0.0), (1.0, 1.0), (-2.0, 0.25)][int(rng.integers(4))]
        if not row_major:  # the kernel computes C^T = op(B)^T op(A)^T: its rows are N
            m, n = n, m
        a, lda = _stored(rng, m, k, trans_a, row_major, pad)
        b, ldb = _stored(rng, k, n, trans_b, row_major, pad)
        c, ldc = _stored(rng, m, n, False, row_major, pad)
        case = dict(row_major=row_major, trans_a=trans_a, trans_b=trans_b, M=m, N=n, K=k)
        case.update(alpha=alpha, beta=beta, A=a, lda=lda, B=b, ldb=ldb, C=c, ldc=ldc)
        cases.append(case)
    return cases


def _call(fn, case: dict, enums: bool, fused: int | None = None) -> np.ndarray:
    """C after fn(case): the shim's cblas_sgemm (enums) or a (fused, row_major, trans_a,
    trans_b, ...) function with booleans."""
    c = case["C"].copy()
    p = case
    if enums:
        head = (101 if p["row_major"] else 102, 112 if p["trans_a"] else 111)
        head += (112 if p["trans_b"] else 111,)
    else:
        head = (p["row_major"], p["trans_a"], p["trans_b"])
        head = head if fused is None else (fused, *head)
    fn(*map(int, head), p["M"], p["N"], p["K"], ctypes.c_float(p["alpha"]),
       p["A"].ctypes.data_as(FLOAT_P), p["lda"], p["B"].ctypes.data_as(FLOAT_P), p["ldb"],
       ctypes.c_float(p["beta"]), c.ctypes.data_as(FLOAT_P), p["ldc"])  # fmt: skip
    return c


def _assert_bitwise(actual: np.ndarray, expected: np.ndarray, case: dict) -> None:
    shape = {k: case[k] for k in ("M", "N", "K", "row_major", "trans_a", "trans_b", "beta")}
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32), str(shape))


@needs_fast
@pytest.mark.parametrize("threads", [1, 2])
def test_the_shim_computes_the_fixed_order_bitwise(reference: ctypes.CDLL, threads: int) -> None:
    """Every product up to the invariant limit -- row and column tiles, panels, K blocks and
    tails, both orders and transposes, padded leading dimensions, alpha and beta, split
    between threads or not -- equals the one-element-at-a-time reference, bit for bit."""
    shim = ctypes.CDLL(blas_info().shim)
    fused = shim.mtplx_invariant_fused()
    try:
        set_blas_threads(threads)
        for case in _cases(seed=threads):
            expected = _call(reference.reference_sgemm, case, enums=False, fused=fused)
            _assert_bitwise(_call(shim.cblas_sgemm, case, enums=True), expected, case)
    finally:
        set_blas_threads(blas_info().threads)


@needs_fast
def test_the_shim_fuses_exactly_when_its_flags_say_so() -> None:
    shim = ctypes.CDLL(blas_info().shim)
    flags = blas_info().shim_flags
    assert flags == blas_shim.compile_flags(platform.machine(), blas_shim.cpu_features())[0]
    fused_flags = "-mfma" in flags or platform.machine() in ("aarch64", "arm64")
    assert shim.mtplx_invariant_fused() == int(fused_flags)


@needs_fast
def test_more_rows_than_the_limit_go_to_openblas() -> None:
    """Beyond INVARIANT_MAX_ROWS (prefill only) the shim's product is OpenBLAS's own."""
    shim = ctypes.CDLL(blas_info().shim)
    openblas = ctypes.CDLL(blas_info().library)
    rng = np.random.default_rng(0)
    m, n, k = INVARIANT_MAX_ROWS + 1, 40, 64
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    results = []
    for sgemm in (shim.cblas_sgemm, openblas.scipy_cblas_sgemm):
        c = np.zeros((m, n), np.float32)
        pointers = [x.ctypes.data_as(FLOAT_P) for x in (a, b, c)]
        # Row-major (101), A as is (111), B transposed (112): C = A B^T.
        sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0), pointers[0], k, pointers[1], k,
              ctypes.c_float(0.0), pointers[2], n)  # fmt: skip
        results.append(c)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], a @ b.T, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not FAST_PATH_EXPECTED, reason="needs a C compiler on Linux")
def test_a_baseline_build_computes_the_unfused_fixed_order(
    reference: ctypes.CDLL, tmp_path: Path
) -> None:
    """The kernel built with the baseline flags (what a CPU without AVX2/FMA gets: no vector
    extensions beyond the architecture's minimum) still computes the fixed order -- unfused
    on x86-64, whose baseline has no FMA -- so the portable build is right, not just built."""
    flags, _ = blas_shim.compile_flags(platform.machine(), frozenset())
    kernel = _compile(tmp_path, "baseline", [KERNEL], flags)
    fused = kernel.mtplx_invariant_fused()
    assert fused == (0 if platform.machine() == "x86_64" else 1)
    for case in _cases(seed=7)[:: len(DEPTHS) // 3]:  # every row count, a third of the depths
        expected = _call(reference.reference_sgemm, case, enums=False, fused=fused)
        _assert_bitwise(_call(kernel.mtplx_sgemm_rows, case, enums=False), expected, case)


# ---------------------------------------------------------------------------------------------
# Flags and cache key
# ---------------------------------------------------------------------------------------------

X86_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n\nprocessor\t: 1\n"
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n"


def test_cpu_features_are_read_from_cpuinfo() -> None:
    assert {"avx2", "fma", "sse2"} <= blas_shim.cpu_features(X86_CPUINFO)
    assert "asimd" in blas_shim.cpu_features(ARM_CPUINFO)
    assert blas_shim.cpu_features("model name: x\n") == frozenset()


@pytest.mark.parametrize(
    "machine, features, vector",
    [
        ("x86_64", {"avx2", "fma", "sse2"}, True),
        ("x86_64", {"avx2", "sse2"}, False),  # AVX2 without FMA: baseline
        ("x86_64", {"avx", "fma"}, False),
        ("x86_64", set(), False),
        ("aarch64", {"asimd"}, False),
    ],
)
def test_flags_come_from_cpu_features_never_native(
    machine: str, features: set[str], vector: bool
) -> None:
    flags, chosen_by = blas_shim.compile_flags(machine, frozenset(features))
    assert not any(f.startswith(("-march", "-mtune", "-mcpu")) for f in flags)
    assert "-ffp-contract=off" in flags  # fusing is the source's decision, never the compiler's
    assert ("-mavx2" in flags and "-mfma" in flags) == vector
    assert chosen_by == ("avx2 fma" if vector else "")


def test_the_cache_key_changes_with_the_flags(tmp_path: Path) -> None:
    library = tmp_path / "libscipy_openblas.so"
    library.write_bytes(b"\x7fELF")
    source = blas_shim.shim_source(("cblas_sgemm", "cblas_dgemm"), machine="x86_64")
    vector = blas_shim.compile_flags("x86_64", frozenset({"avx2", "fma"}))
    baseline = blas_shim.compile_flags("x86_64", frozenset())
    keys = {
        blas_shim.shim_key(source, library, *vector),
        blas_shim.shim_key(source, library, *baseline),
        blas_shim.shim_key(source, library, vector[0], ""),  # same flags, other features
    }
    assert len(keys) == 3
    assert blas_shim.shim_key(source, library, *vector) == blas_shim.shim_key(
        source, library, *vector
    )


def test_a_cpu_without_the_features_gets_its_own_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shared cache (home directory, image) never hands an AVX2 build to a CPU without it."""
    library = tmp_path / "libscipy_openblas.so"
    library.write_bytes(b"\x7fELF")
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.setattr(blas_shim.platform, "machine", lambda: "x86_64")
    targets = {}
    for name, features in (("vector", {"avx2", "fma"}), ("baseline", set())):
        monkeypatch.setattr(blas_shim, "cpu_features", lambda f=features: frozenset(f))
        targets[name] = blas_shim.shim_target(("cblas_sgemm",), library)
    assert targets["vector"][0] != targets["baseline"][0]
    assert targets["vector"][0].parent == tmp_path / "blas"
    assert "-mavx2" in targets["vector"][2] and "-mavx2" not in targets["baseline"][2]
