"""Batch-invariant quantized products on the CPU: ``x @ dequantize(w, scales, biases).T``.

The kernel (``quant_kernel.c``) takes MLX's affine layout as it is (4 or 8 bits, group sizes
32/64/128, ``w = scale * q + bias`` per group), unpacks every weight once per call for all
rows, and sums each output element in one fixed order that depends on nothing but that
element's inputs, so a token's logits are bitwise the same alone, among other rows, inside
a verify of k+1 tokens and across prefill chunk sizes. ``quant_ext.cpp`` wraps it as an MLX
primitive, so the product stays in MLX's lazy graph (``mx.compile``, ``async_eval``).

Both are compiled on first use and cached under ``$MTPLX_HOME/quant`` (default
``~/.cache/mtplx/quant``), like the BLAS shim (``mtplx.blas_shim``): the kernel's vector
variant is picked from the features the CPU reports (AVX-512, AVX2 + FMA, or the portable
baseline; never ``-march=native``), and the variant's flags, the sources, MLX's and
nanobind's versions and the Python ABI are in the cache key, so a cached build never runs
where it was not built for. Building needs a C/C++ compiler and the ``nanobind`` package
(a build dependency: its sources are compiled into the extension). ``MTPLX_QUANT_VARIANT``
forces a variant (``avx512vnni``, ``avx512``, ``avx2``, ``portable``), e.g. to compare them
in tests.

The same extension holds the fused attention kernel (``attn_kernel.c``, ``mtplx.attention``):
one build, one cache entry, the same variants.

On Metal, MLX's own quantized kernels serve (``mx.quantized_matmul``); the bitwise
guarantees above are this CPU kernel's.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from mtplx.blas_shim import Unavailable, cpu_features
from mtplx.build_dirs import build_target, mtplx_home, scratch_dir

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "QuantInfo",
    "Unavailable",
    "available",
    "dequantize_rows",
    "embed_rows",
    "kernel_variant",
    "load_extension",
    "loaded",
    "qmm",
    "quant_info",
    "runnable_variants",
    "set_threads",
]

_VERSION = 3  # bump when the build recipe changes, to invalidate cached builds
_HERE = Path(__file__).resolve().parent
_KERNEL = _HERE / "quant_kernel.c"
_ATTENTION = _HERE / "attn_kernel.c"  # the fused attention (``mtplx.attention``), same library
_LAYER = _HERE / "layer_kernel.c"  # the fused layer halves (``mtplx.fused_layer``), same library
_EXT = _HERE / "quant_ext.cpp"

# Variant -> (the CPU features it needs, the compiler flags it is built with). FMA is part
# of every x86 vector variant, so they all fuse their multiply-adds (quant_kernel.c).
_VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # AVX-512 with VNNI (vpdpbusd: 64 u8 x s8 products an instruction) for the integer-dot
    # mode; the float mode compiles to the same code as "avx512".
    "avx512vnni": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
    ),
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
    ),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "portable": ((), ()),
}
# How a product treats its rows (``qmm``'s ``activations``).
ACTIVATIONS = ("int8", "float32")
_C_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-pthread", "-Wno-psabi")
_CXX_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing")


@dataclass(frozen=True)
class QuantInfo:
    """What serves quantized products here: the kernel variant and its build, or why not."""

    available: bool
    variant: str | None = None
    lanes: int | None = None
    fused: bool | None = None
    threads: int | None = None
    library: str | None = None
    reason: str | None = None

    @property
    def kernel(self) -> str:
        """A short name for reports: ``mtplx-invariant-avx2``, ``mlx`` (Metal), ..."""
        if mx.default_device() != mx.cpu:
            return "mlx"
        return f"mtplx-invariant-{self.variant}" if self.available else "unavailable"


_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def runnable_variants(
    features: frozenset[str] | None = None, machine: str | None = None
) -> list[str]:
    """The variants whose instructions this CPU runs, widest first (``portable`` last)."""
    features = cpu_features() if features is None else features
    machine = machine or platform.machine()
    runnable = []
    if machine in ("x86_64", "AMD64"):
        runnable = [
            n
            for n in ("avx512vnni", "avx512", "avx2")
            if all(f in features for f in _VARIANTS[n][0])
        ]
    return [*runnable, "portable"]


def kernel_variant(features: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The variant this CPU runs: the widest whose features it reports, or the forced one."""
    forced = os.environ.get("MTPLX_QUANT_VARIANT", "").strip().lower()
    if forced:
        if forced not in _VARIANTS:
            raise Unavailable(f"MTPLX_QUANT_VARIANT={forced!r}: not one of {sorted(_VARIANTS)}")
        return forced
    return runnable_variants(features, machine)[0]


def cache_dir() -> Path:
    return mtplx_home() / "quant"


def _nanobind() -> Path:
    spec = importlib.util.find_spec("nanobind")
    if spec is None or spec.origin is None:
        raise Unavailable("nanobind is not installed (pip install nanobind): it builds the kernel")
    return Path(spec.origin).parent


def _mlx_root() -> Path:
    """The installed mlx package (core's directory: ``mlx`` is a namespace package)."""
    root = Path(mx.__file__).resolve().parent
    if not (root / "include" / "mlx" / "mlx.h").exists():
        raise Unavailable(f"the mlx package at {root} ships no C++ headers")
    return root


def _compilers() -> tuple[str, str]:
    cc = shutil.which(os.environ.get("CC", "")) if os.environ.get("CC") else None
    cxx = shutil.which(os.environ.get("CXX", "")) if os.environ.get("CXX") else None
    cc = cc or next((c for c in map(shutil.which, ("cc", "gcc", "clang")) if c), None)
    cxx = cxx or next((c for c in map(shutil.which, ("c++", "g++", "clang++")) if c), None)
    if not cc or not cxx:
        raise Unavailable("no C and C++ compiler to build the quantized kernel")
    return cc, cxx


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise Unavailable(f"compiling {what} failed: {done.stderr.strip()[-800:]}")


def _target(variant: str) -> tuple[Path, dict[str, object]]:
    nb = _nanobind()
    mlx_root = _mlx_root()
    nb_version = (nb / "__init__.py").read_text()
    key_parts = [
        str(_VERSION),
        variant,
        " ".join(_VARIANTS[variant][1] + _C_FLAGS + _CXX_FLAGS),
        _KERNEL.read_text(),
        _ATTENTION.read_text(),
        _LAYER.read_text(),
        _EXT.read_text(),
        mx.__version__,  # type: ignore[attr-defined]  # set at runtime, absent from the stubs
        str((mlx_root / "lib" / "libmlx.so").stat().st_size)
        if (mlx_root / "lib" / "libmlx.so").exists()
        else "",
        hashlib.sha256(nb_version.encode()).hexdigest(),
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        sys.version,
    ]
    key = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"_mtplx_quant-{variant}-{key}.so"
    return target, {"nb": nb, "mlx": mlx_root}


def build(variant: str) -> Path:
    """Compile the extension for ``variant`` once; reuse the cached library after."""
    target, where = _target(variant)
    # Built for this run only where MTPLX_HOME cannot be written (``mtplx.build_dirs``).
    target = build_target(target)
    if target.exists():
        return target
    nb, mlx_root = Path(str(where["nb"])), Path(str(where["mlx"]))
    cc, cxx = _compilers()
    includes = [
        f"-I{nb / 'include'}",
        f"-I{nb / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the quantized kernel (%s) into %s (first use)", variant, target)
    with scratch_dir(target.parent) as tmp:
        out = tmp
        kernel_o, ext_o, lib = out / "k.o", out / "e.o", out / "ext.so"
        attention_o, layer_o = out / "a.o", out / "l.o"
        for source, obj in ((_KERNEL, kernel_o), (_ATTENTION, attention_o), (_LAYER, layer_o)):
            _run(
                [cc, *_C_FLAGS, *_VARIANTS[variant][1], "-c", str(source), "-o", str(obj)],
                source.name,
            )
        nb_o = _nanobind_object(cxx, nb, includes)
        _run(
            [
                cxx,
                *_CXX_FLAGS,
                # The domain MLX's own bindings use: mx.array converts across modules.
                "-DNB_DOMAIN=mlx",
                *includes,
                f"-I{mlx_root / 'include'}",
                "-c",
                str(_EXT),
                "-o",
                str(ext_o),
            ],
            "quant_ext.cpp",
        )
        _run(
            [
                cxx,
                "-shared",
                "-o",
                str(lib),
                str(ext_o),
                str(nb_o),
                str(kernel_o),
                str(attention_o),
                str(layer_o),
                f"-L{mlx_root / 'lib'}",
                "-lmlx",
                f"-Wl,-rpath,{mlx_root / 'lib'}",
                "-pthread",
            ],
            "the quantized kernel's extension",
        )
        os.replace(lib, target)  # atomic: concurrent processes never see half a library
    return target


def _nanobind_object(cxx: str, nb: Path, includes: list[str]) -> Path:
    """nanobind's runtime compiled once (the slow part of a build), shared by every variant."""
    flags = [*_CXX_FLAGS, "-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS", *includes]
    source = nb / "src" / "nb_combined.cpp"
    key = hashlib.sha256(
        "\n".join([cxx, " ".join(flags), (nb / "__init__.py").read_text(), sys.version]).encode()
    ).hexdigest()[:16]
    target = build_target(cache_dir() / f"nanobind-{key}.o")
    if not target.exists():
        with scratch_dir(target.parent) as tmp:
            out = tmp / "nb.o"
            _run([cxx, *flags, "-c", str(source), "-o", str(out)], "nanobind")
            os.replace(out, target)
    return target


def load_extension() -> ModuleType:
    """The compiled extension module (built on first use); raises ``Unavailable``."""
    global _module, _failure
    if _module is not None:  # loaded once, never unloaded: no lock on the every-product path
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise Unavailable(_failure)
        try:
            if sys.platform != "linux":
                raise Unavailable(
                    f"the CPU quantized kernel is built on Linux only ({sys.platform})"
                )
            path = build(kernel_variant())
            loader = importlib.machinery.ExtensionFileLoader("_mtplx_quant", str(path))
            spec = importlib.util.spec_from_file_location("_mtplx_quant", path, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except Unavailable as exc:
            _failure = str(exc)
            raise
        except (OSError, ImportError, subprocess.SubprocessError) as exc:
            _failure = f"{type(exc).__name__}: {exc}"
            raise Unavailable(_failure) from exc
        try:
            # MLX arrays cross into the extension only when both were built against the same
            # nanobind ABI; a mismatch shows here as a TypeError, not in a forward.
            probe = module.qmm(
                mx.ones((1, 32)),
                mx.zeros((1, 4), mx.uint32),
                mx.ones((1, 1)),
                mx.zeros((1, 1)),
                4,
                32,
            )
            mx.eval(probe)
        except (TypeError, RuntimeError, ValueError) as exc:
            _failure = f"the built extension does not run with this mlx: {exc}"
            raise Unavailable(_failure) from exc
        module.set_threads(_default_threads())
        _module = module
        return module


def _default_threads() -> int:
    for var in ("MTPLX_QUANT_THREADS", "MTPLX_BLAS_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0))


def loaded() -> bool:
    """Whether this process has loaded the extension (a quantized model is being served)."""
    return _module is not None


def available() -> bool:
    """Whether the CPU kernel can serve here (built, or buildable now)."""
    try:
        load_extension()
        return True
    except Unavailable:
        return False


def quant_info() -> QuantInfo:
    """The kernel in use (building it if needed); never raises."""
    try:
        ext = load_extension()
    except Unavailable as exc:
        return QuantInfo(available=False, reason=str(exc))
    return QuantInfo(
        available=True,
        variant=kernel_variant(),
        lanes=int(ext.lanes()),
        fused=bool(ext.fused()),
        threads=int(ext.threads()),
        library=str(ext.__file__),
    )


def set_threads(threads: int) -> None:
    """Threads (the caller included) that split a large product's columns between them;
    each element is still computed whole by one thread, so no bit changes."""
    load_extension().set_threads(max(1, int(threads)))


def qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    group_size: int,
    activations: str = "float32",
) -> mx.array:
    """``x @ dequantize(w, scales, biases, group_size, bits).T`` (float32), lazily.

    On the CPU: the batch-invariant kernel. ``activations="float32"`` multiplies x by the
    dequantized weights exactly as a float32 product would (to its rounding);
    ``activations="int8"`` quantizes each row of x per weight group to 8 bits and uses
    integer dot products (``quant_kernel.c`` defines the arithmetic; faster, different
    numbers, equally batch-invariant). Elsewhere (Metal): ``mx.quantized_matmul``, which
    ignores ``activations``.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
    if mx.default_device() != mx.cpu:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
        )
    return load_extension().qmm(x, w, scales, biases, bits, group_size, activations == "int8")


def embed_rows(
    ids: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    group_size: int,
) -> mx.array:
    """Rows ``ids`` [...] of a quantized table w [V, H * bits / 32], dequantized -> [..., H]
    float32, lazily: on the CPU one node of the extension (``embed_rows``), bitwise
    ``dequantize_rows``; elsewhere, or without the extension, ``dequantize_rows`` itself."""
    if mx.default_device() == mx.cpu and bits in (2, 4, 8):
        try:
            return load_extension().embed_rows(ids, w, scales, biases, bits, group_size)
        except Unavailable:
            pass
    return dequantize_rows(ids, w, scales, biases, bits, group_size)


def dequantize_rows(
    ids: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    group_size: int,
) -> mx.array:
    """``embed_rows`` in MLX's ops (the reference): the rows gathered, then
    ``mx.dequantize`` with float32 scales and biases (~35 graph nodes on the CPU)."""
    return mx.dequantize(
        w[ids],
        scales=scales[ids].astype(mx.float32),
        biases=biases[ids].astype(mx.float32),
        group_size=group_size,
        bits=bits,
    )
