"""Route MLX's CPU matmuls to OpenBLAS on Linux.

The ``mlx[cpu]`` wheel's ``libmlx.so`` is linked against the reference (netlib) BLAS and
LAPACK bundled in ``mlx_cpu.libs``. Reference ``sgemm`` is not blocked for caches and does not
vectorise, so a verify forward over 8 tokens costs ~7x one token instead of ~1.4x: that
destroys the point of speculative decoding on CPU.

OpenBLAS from the ``scipy-openblas32`` wheel exports the same routines, but with a
``scipy_`` prefix (``scipy_cblas_sgemm``), so ``LD_PRELOAD`` cannot interpose it. We therefore
compile, once, a tiny shim library whose every exported symbol is a bare tail jump
(``cblas_sgemm: jmp scipy_cblas_sgemm``) and load it with ``RTLD_GLOBAL`` *before* MLX is
imported. When ``libmlx.so`` is later loaded, the dynamic linker resolves its undefined
symbols in the global scope first, so the shim wins over libmlx's own ``DT_NEEDED`` libblas.
Jumps instead of C wrappers keep the shim signature-agnostic (the LAPACK routines carry
hidden Fortran string-length arguments) and add no stack frame.

The shim is built by ``mtplx.blas_shim`` and cached under ``$MTPLX_HOME/blas`` (default
``~/.cache/mtplx/blas``), keyed by the OpenBLAS library, the symbol list and the compiler
flags (chosen from the CPU's features, never ``-march=native``). Whenever anything is
missing (not Linux, no compiler, no ``scipy-openblas32``, MLX already imported) we log why
and keep the reference BLAS, which is slow but correct. ``MTPLX_BLAS=reference`` opts out
deliberately.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from mtplx.blas_shim import INVARIANT_MAX_ROWS, PREFIX, Unavailable, build_shim

logger = logging.getLogger(__name__)

__all__ = [
    "INVARIANT_MAX_ROWS",
    "BlasInfo",
    "blas_info",
    "enable_fast_blas",
    "set_blas_threads",
    "shim_calls",
]

# What libmlx 0.32 imports; used only when the ELF symbol table cannot be read.
_KNOWN_SYMBOLS = [
    "cblas_sgemm",
    "cblas_dgemm",
    "cblas_cgemm",
    "cgeev_",
    "cgesdd_",
    "cheevd_",
    "dgeev_",
    "dgeqrf_",
    "dgesdd_",
    "dgetrf_",
    "dgetri_",
    "dorgqr_",
    "dpotrf_",
    "dsyevd_",
    "dtrtri_",
    "sgeev_",
    "sgeqrf_",
    "sgesdd_",
    "sgetrf_",
    "sgetri_",
    "sorgqr_",
    "spotrf_",
    "ssyevd_",
    "strtri_",
]


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU backend calls.

    ``fast`` is true when the OpenBLAS shim is loaded ahead of libmlx; otherwise
    ``fallback_reason`` says why the reference BLAS is in use.
    """

    name: str
    library: str | None
    threads: int | None
    fast: bool
    fallback_reason: str | None = None
    shim: str | None = None
    symbols: tuple[str, ...] = ()
    shim_flags: tuple[str, ...] = ()  # what the shim was compiled with (mtplx.blas_shim)


_lock = threading.Lock()
_info: BlasInfo | None = None
_openblas: ctypes.CDLL | None = None
_shim: ctypes.CDLL | None = None


def _reference(reason: str) -> BlasInfo:
    return BlasInfo(name="reference", library=None, threads=1, fast=False, fallback_reason=reason)


def blas_info() -> BlasInfo:
    """The BLAS in use now (``enable_fast_blas`` not yet called counts as a fallback)."""
    if _info is not None:
        if _openblas is not None:
            # Threads may have been changed since (set_blas_threads, OpenBLAS itself).
            threads = int(_openblas[PREFIX + "openblas_get_num_threads"]())
            return replace(_info, threads=threads)
        return _info
    return _reference("enable_fast_blas() has not been called")


def enable_fast_blas(threads: int | None = None) -> BlasInfo:
    """Make MLX's CPU backend call OpenBLAS; idempotent, never raises.

    Must run before ``mlx.core`` is first imported (``import mtplx`` does it). ``threads``
    defaults to ``$MTPLX_BLAS_THREADS``, then ``$OPENBLAS_NUM_THREADS``, then the CPUs this
    process may run on. On any failure the reference BLAS stays and the reason is logged.
    """
    global _info
    with _lock:
        if _info is None:
            _info = _enable(threads)
            if _info.fast:
                logger.info(
                    "BLAS: OpenBLAS via shim (%d symbols, %s threads) from %s",
                    len(_info.symbols),
                    _info.threads,
                    _info.library,
                )
            elif _deliberate(_info.fallback_reason or ""):
                logger.info("BLAS: reference BLAS (%s)", _info.fallback_reason)
            else:
                logger.warning(
                    "BLAS: falling back to the slow reference BLAS: %s", _info.fallback_reason
                )
        elif threads is not None and _openblas is not None:
            set_blas_threads(threads)
        return blas_info()


def set_blas_threads(threads: int) -> None:
    """Set the thread count of OpenBLAS and of the batch-invariant kernel (a no-op on the
    reference BLAS, which is single-threaded)."""
    if _openblas is not None:
        _openblas[PREFIX + "openblas_set_num_threads"](max(1, int(threads)))
    if _shim is not None and hasattr(_shim, "mtplx_invariant_set_threads"):
        _shim.mtplx_invariant_set_threads(max(1, int(threads)))


def shim_calls() -> int | None:
    """How many times libmlx went through the shim (x86_64 only; ``None`` if unknown).

    Lets tests and ``mtplx inspect`` prove the interposition really happened, rather than
    inferring it from timings.
    """
    if _shim is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    fn = _shim.mtplx_blas_shim_calls
    fn.restype = ctypes.c_ulong
    return int(fn())


def _deliberate(reason: str) -> bool:
    return reason.startswith(("MTPLX_BLAS=", "not Linux"))


def _enable(threads: int | None) -> BlasInfo:
    global _openblas, _shim
    choice = os.environ.get("MTPLX_BLAS", "auto").strip().lower()
    if choice in ("reference", "off", "0", "none"):
        return _reference(f"MTPLX_BLAS={choice}")
    if sys.platform != "linux":
        return _reference(f"not Linux ({sys.platform}): MLX uses its platform BLAS")
    if "mlx.core" in sys.modules or _libmlx_mapped():
        return _reference("mlx was imported before enable_fast_blas(); import mtplx first")
    try:
        libmlx = _find_libmlx()
        openblas_path = _find_openblas()
        wanted = _blas_imports(libmlx)
        if not any(s.startswith("cblas_") for s in wanted):
            return _reference(f"{libmlx.name} imports no CBLAS symbols (static BLAS?)")
        # RTLD_LOCAL: only the shim should be visible globally, not OpenBLAS's own exports.
        openblas = ctypes.CDLL(str(openblas_path))
        symbols = tuple(s for s in wanted if hasattr(openblas, PREFIX + s))
        shim_path, shim_flags = build_shim(symbols, openblas_path)
        shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    except Unavailable as exc:
        return _reference(str(exc))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:  # never break start-up
        return _reference(f"{type(exc).__name__}: {exc}")
    _openblas, _shim = openblas, shim
    set_blas_threads(threads or _default_threads())
    return BlasInfo(
        name="openblas",
        library=str(openblas_path),
        threads=int(openblas[PREFIX + "openblas_get_num_threads"]()),
        fast=True,
        shim=str(shim_path),
        symbols=symbols,
        shim_flags=shim_flags,
    )


def _default_threads() -> int:
    for var in ("MTPLX_BLAS_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    # The affinity mask, not os.cpu_count(): containers and taskset restrict it.
    return len(os.sched_getaffinity(0))


def _libmlx_mapped() -> bool:
    """True if libmlx.so is already in this process (loaded by something other than mlx.core)."""
    try:
        return "libmlx.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _find_libmlx() -> Path:
    spec = importlib.util.find_spec("mlx")  # does not import mlx (namespace package)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("mlx is not installed")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / "lib" / "libmlx.so"
        if candidate.exists():
            return candidate
    raise Unavailable("libmlx.so not found in the mlx package")


def _find_openblas() -> Path:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or spec.origin is None:
        raise Unavailable("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    libs = sorted((Path(spec.origin).parent / "lib").glob("libscipy_openblas*.so*"))
    if not libs:
        raise Unavailable("scipy-openblas32 ships no libscipy_openblas*.so")
    return libs[0]


def _blas_imports(lib: Path) -> list[str]:
    """CBLAS and Fortran LAPACK symbols ``lib`` leaves undefined (it expects from libblas)."""
    try:
        names = _undefined_dynamic_symbols(lib.read_bytes())
    except (OSError, ValueError, struct.error):
        return list(_KNOWN_SYMBOLS)
    # Fortran LAPACK names are lower case with a trailing underscore (sgesdd_), like nothing
    # else libmlx imports from libc/libstdc++.
    return sorted(
        n for n in names if n.startswith("cblas_") or (n.endswith("_") and n[:-1].isalnum())
    )


def _undefined_dynamic_symbols(elf: bytes) -> set[str]:
    """Undefined names of an ELF64 little-endian object's ``.dynsym`` (no binutils needed)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        str_off = sections[link][4]
        for pos in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            st_name, _st_info, _other, st_shndx = struct.unpack_from("<IBBH", elf, pos)
            if st_shndx == 0:  # SHN_UNDEF
                end = elf.index(b"\0", str_off + st_name)
                names.add(elf[str_off + st_name : end].decode())
    return names
