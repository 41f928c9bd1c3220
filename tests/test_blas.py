"""mtplx.blas: OpenBLAS really replaces the reference BLAS, gives the same numbers, and every
fallback says why."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from mtplx.blas import INVARIANT_MAX_ROWS, blas_info, enable_fast_blas, shim_calls

ROOT = Path(__file__).resolve().parents[1]
FAST_PATH_EXPECTED = (
    sys.platform == "linux"
    and platform.machine() in ("x86_64", "aarch64")
    and shutil.which("cc") is not None
    and os.environ.get("MTPLX_BLAS", "auto") == "auto"
)
needs_fast = pytest.mark.skipif(not FAST_PATH_EXPECTED, reason="fast BLAS not expected here")

# Float32 logits of the two BLAS differ only by GEMM summation order; over 2 layers of width
# 64 that stays around 1e-6 relative, so 1e-4 is tight enough to catch a wrong routine.
LOGIT_RTOL = 1e-4
LOGIT_ATOL = 1e-4


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (BLAS choice is fixed once per process)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


@needs_fast
def test_fast_path_is_active() -> None:
    info = blas_info()
    assert info.fast, info.fallback_reason
    assert info.name == "openblas"
    assert info.threads is not None and info.threads >= 1
    assert {"cblas_sgemm", "cblas_dgemm", "cblas_cgemm"} <= set(info.symbols)
    assert enable_fast_blas() == info  # idempotent


@needs_fast
@pytest.mark.skipif(platform.machine() != "x86_64", reason="call counter is x86_64 only")
def test_matmul_goes_through_the_shim() -> None:
    before = shim_calls()
    a = mx.random.normal((8, 64))
    b = mx.random.normal((64, 128))
    out = a @ b
    mx.eval(out)
    assert shim_calls() > before
    np.testing.assert_allclose(np.array(out), np.array(a) @ np.array(b), rtol=1e-4, atol=1e-4)


_LOGITS_SCRIPT = """
import mtplx
from mtplx.blas import blas_info
import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    vocab_size=256, tie_word_embeddings=False)
model = llama.Model(args)
model.load_weights("{weights}")
logits = model(mx.array([[1, 5, 9, 200, 17, 3, 77, 255]]))
np.save("{out}", np.array(logits.astype(mx.float32)))
print(blas_info().name)
"""


@needs_fast
def test_reference_and_fast_blas_give_the_same_logits(tmp_path: Path) -> None:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    weights = tmp_path / "w.safetensors"
    model.save_weights(str(weights))
    results = {}
    for choice in ("auto", "reference"):
        out = tmp_path / f"{choice}.npy"
        done = _run(_LOGITS_SCRIPT.format(weights=weights, out=out), {"MTPLX_BLAS": choice})
        assert done.returncode == 0, done.stderr
        results[done.stdout.strip()] = np.load(out)
    assert set(results) == {"openblas", "reference"}
    np.testing.assert_allclose(
        results["openblas"], results["reference"], rtol=LOGIT_RTOL, atol=LOGIT_ATOL
    )


def test_opt_out_is_logged() -> None:
    done = _run(
        """
        import logging; logging.basicConfig(level=logging.INFO)
        import mtplx
        import mlx.core  # the first MLX import is what enables (or declines) the fast BLAS
        from mtplx.blas import blas_info
        print(blas_info().fast, blas_info().fallback_reason)
        """,
        {"MTPLX_BLAS": "reference"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False MTPLX_BLAS=reference"
    assert "reference BLAS (MTPLX_BLAS=reference)" in done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="Linux-only fast path")
def test_importing_mlx_first_falls_back_with_a_warning() -> None:
    # No logging configured: a WARNING still reaches stderr through logging's last resort.
    done = _run(
        "import mlx.core\nimport mtplx\nfrom mtplx.blas import blas_info\n"
        "print(blas_info().fast)\n",
        {"MTPLX_BLAS": "auto"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "falling back to the slow reference BLAS" in done.stderr
    assert "mlx was imported before" in done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="Linux-only fast path")
def test_missing_compiler_falls_back_with_a_warning(tmp_path: Path) -> None:
    # An empty MTPLX_HOME has no cached shim, so the (absent) compiler would be needed.
    done = _run(
        "import mtplx\nimport mlx.core\nfrom mtplx.blas import blas_info\n"
        "print(blas_info().fast)\n",
        {"MTPLX_BLAS": "auto", "MTPLX_HOME": str(tmp_path), "CC": "no-such-compiler"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "no C compiler (no-such-compiler)" in done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="Linux-only fast path")
def test_an_unwritable_home_still_gets_the_fast_blas_built_for_the_run(tmp_path: Path) -> None:
    # MTPLX_HOME below a file cannot be made: the shim is built into a temporary directory
    # (removed at exit) rather than the process falling back to the reference BLAS.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = _run(
        "import mtplx\nimport mlx.core\nfrom mtplx.blas import blas_info\n"
        "print(blas_info().fast)\n",
        {"MTPLX_BLAS": "auto", "MTPLX_HOME": str(blocker / "home")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stderr
    assert "cannot write" in done.stderr and "for this run only" in done.stderr
    stand_in = Path(done.stderr.split("what goes there in ")[1].split()[0].rstrip(","))
    assert not stand_in.exists()


# ---------------------------------------------------------------------------------------------
# Batch invariance: a token's numbers do not depend on how many tokens share the forward
# ---------------------------------------------------------------------------------------------


# Every row count a decode batch step can produce (up to 16 sequences x 6 tokens = 96), across
# the kernel's row tiles (4), row blocks (8) and the invariant limit.
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 96, 128)
assert max(ROW_COUNTS) == INVARIANT_MAX_ROWS


def _operand(rng: np.random.Generator, rows: int, cols: int, layout: str) -> mx.array:
    """A rows x cols operand stored as ``layout``: "rows" (row-major), "transposed" (the
    transpose of a row-major array, so BLAS gets the transpose flag) or "strided" (a
    column slice of a wider array: leading dimension > cols)."""
    if layout == "rows":
        return mx.array(rng.standard_normal((rows, cols)).astype(np.float32))
    if layout == "transposed":
        return mx.array(rng.standard_normal((cols, rows)).astype(np.float32)).T
    wide = mx.array(rng.standard_normal((rows, cols + 5)).astype(np.float32))
    return wide[:, 2 : cols + 2]


@pytest.mark.parametrize(
    "inner, outer",
    [(64, 259), (576, 192), (576, 1536), (1536, 576), (100, 49), (17, 300), (7, 33), (769, 85)],
)
@pytest.mark.parametrize(
    "x_layout, w_layout",
    [
        ("rows", "transposed"),
        ("rows", "rows"),
        ("transposed", "transposed"),
        ("strided", "strided"),
    ],
)
def test_matmul_rows_do_not_depend_on_row_count(
    inner: int, outer: int, x_layout: str, w_layout: str
) -> None:
    """Row r of x[:M] @ W is bitwise the row that x[r] @ W gives alone, for every row count
    up to the invariant limit: x @ W.T (linear layers, w_layout "transposed") and x @ W
    (attention's scores @ values), K below 16 and not a multiple of 16, strided operands."""
    rng = np.random.default_rng(inner * 1000 + outer)
    x = _operand(rng, INVARIANT_MAX_ROWS, inner, x_layout)
    weight = _operand(rng, inner, outer, w_layout)
    alone = np.concatenate([np.array(x[r : r + 1] @ weight) for r in range(x.shape[0])])
    for m in ROW_COUNTS:
        np.testing.assert_array_equal(np.array(x[:m] @ weight), alone[:m], err_msg=f"{m} rows")


def test_weight_layout_does_not_change_a_bit() -> None:
    """x @ W computes the same bits whether W is stored row-major or as a transposed view:
    the kernel packs B's columns contiguous before the same fixed-order arithmetic."""
    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((3, 300)).astype(np.float32))
    w = rng.standard_normal((64, 300)).astype(np.float32)
    as_view = np.array(x @ mx.array(w).T)
    as_rows = np.array(x @ mx.array(w.T.copy()))
    np.testing.assert_array_equal(as_view, as_rows)


@pytest.mark.parametrize("rows", [1, 3, 9, 16])
@pytest.mark.parametrize("padded_length", [45, 48, 64, 100])
def test_trailing_zero_terms_do_not_change_a_dot_product(rows: int, padded_length: int) -> None:
    """Masked attention keys contribute exact zeros after the live ones; they must not
    change the sum (plain decoding sees L keys, a verify row L + k with k masked, a row in a
    batch the longest row's length): across chunk boundaries too, where the live tail of the
    short product meets full chunks of the long one."""
    rng = np.random.default_rng(3)
    scores = rng.random((rows, 37)).astype(np.float32)
    values = rng.standard_normal((padded_length, 65)).astype(np.float32)
    padding = np.zeros((rows, padded_length - 37), np.float32)
    padded = np.concatenate([scores, padding], axis=1)
    short = np.array(mx.array(scores) @ mx.array(values[:37]))
    long = np.array(mx.array(padded) @ mx.array(values))
    np.testing.assert_array_equal(short, long)
    transposed = np.array(mx.array(padded) @ mx.array(values.T.copy()).T)  # B read by columns
    np.testing.assert_array_equal(short, transposed)


def test_multi_token_forward_equals_one_token_forwards_bitwise() -> None:
    """The whole model: logits of 6 tokens in one forward equal 6 one-token forwards."""
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=300,
    )
    model = llama.Model(args)
    tokens = mx.array([[5, 17, 200, 42, 7, 99, 100, 3, 250, 11]])
    from mlx_lm.models.cache import make_prompt_cache

    one_cache, multi_cache = make_prompt_cache(model), make_prompt_cache(model)
    model(tokens[:, :4], cache=one_cache)
    model(tokens[:, :4], cache=multi_cache)
    one = mx.concatenate([model(tokens[:, i : i + 1], cache=one_cache) for i in range(4, 10)], 1)
    multi = model(tokens[:, 4:10], cache=multi_cache)
    np.testing.assert_array_equal(np.array(one), np.array(multi))


def test_a_sequence_in_a_batch_of_16_equals_it_alone_bitwise() -> None:
    """Continuous batching's verify step: 16 sequences x (1 + 5 draft tokens) in one forward
    (96-row products) give each sequence the logits it gets alone, bit for bit."""
    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=300,
    )
    model = llama.Model(args)
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array(np.random.default_rng(2).integers(0, 300, (16, 10)), dtype=mx.int32)
    batch_cache = make_prompt_cache(model)
    model(tokens[:, :4], cache=batch_cache)
    batched = np.array(model(tokens[:, 4:], cache=batch_cache))
    for b in range(16):
        cache = make_prompt_cache(model)
        model(tokens[b : b + 1, :4], cache=cache)
        alone = np.array(model(tokens[b : b + 1, 4:], cache=cache))
        np.testing.assert_array_equal(batched[b : b + 1], alone, err_msg=f"sequence {b}")


def _shim_function(name: str, restype: object) -> object:
    import ctypes

    function = getattr(ctypes.CDLL(blas_info().shim), name)
    function.restype = restype
    return function


@needs_fast
def test_threads_split_large_products_without_changing_a_bit() -> None:
    """The invariant kernel splits a large product's columns between threads; every element
    is still computed whole by one thread, so 1 and 2 threads give the same bits."""
    import ctypes

    from mtplx.blas import set_blas_threads

    split_products = _shim_function("mtplx_invariant_split_products", ctypes.c_ulong)
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((INVARIANT_MAX_ROWS, 576)).astype(np.float32))
    w = mx.array(rng.standard_normal((4099, 576)).astype(np.float32))
    rows = (1, 2, 5, 17, 96, INVARIANT_MAX_ROWS)
    results = {}
    try:
        for threads in (1, 2, 3):
            set_blas_threads(threads)
            before = split_products()
            results[threads] = [np.array(x[:m] @ w.T) for m in rows]
            assert (split_products() > before) == (threads > 1)
    finally:
        set_blas_threads(blas_info().threads)
    for threads in (2, 3):
        for i, m in enumerate(rows):
            np.testing.assert_array_equal(results[threads][i], results[1][i], err_msg=f"{m}")


@needs_fast
def test_a_forked_child_can_still_multiply() -> None:
    """Helper threads do not survive fork(): a child's products must not wait on them."""
    import ctypes

    from mtplx.blas import set_blas_threads

    sgemm = _shim_function("cblas_sgemm", None)
    m, n, k = 1, 4096, 576
    rng = np.random.default_rng(6)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    c = np.zeros((m, n), np.float32)

    def multiply() -> None:
        pointer = ctypes.POINTER(ctypes.c_float)
        # Row-major (101), A not transposed (111), B transposed (112): C = A B^T.
        sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0),
              a.ctypes.data_as(pointer), k, b.ctypes.data_as(pointer), k, ctypes.c_float(0.0),
              c.ctypes.data_as(pointer), n)  # fmt: skip

    set_blas_threads(2)
    multiply()  # starts the helper thread in this process
    np.testing.assert_allclose(c, a @ b.T, rtol=1e-4, atol=1e-3)
    pid = os.fork()
    if pid == 0:  # the child: multiply again, then leave at once
        multiply()
        os._exit(0 if np.allclose(c, a @ b.T, rtol=1e-4, atol=1e-3) else 1)
    deadline = 30.0
    while deadline > 0:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
        deadline -= 0.1
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung in the invariant kernel")
