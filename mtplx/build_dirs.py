"""``$MTPLX_HOME``, and where what is made on first use goes when it cannot take it.

Everything MTPLX makes once and reuses lives under ``mtplx_home()``: the BLAS shim
(``mtplx.blas_shim``) and the quantized kernel (``mtplx.quant``) in ``blas`` and ``quant``,
the default model converted from its packaged GGUF in ``models``, start-up calibrations in
``calibration`` (or ``$MTPLX_CALIBRATION_DIR``: ``calibration_dir``). Where a directory
cannot be written (``MTPLX_HOME`` read only, or under a file) what is already there is still
used; what must be made goes into a private temporary directory of this process instead,
removed at exit (``remove_stand_ins``), with one warning.
Without it the process would run on the slow fallbacks (the reference BLAS, quantized
weights dequantized to float32: every step, the start-up calibration's included, several
times slower) or, for the default model, not start at all. The price is the work again at
every start.

A build works in a scratch directory beside its target (``scratch_dir``) and renames the
result into place; one that a killed process left behind is removed by the next build there.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "build_target",
    "calibration_dir",
    "mtplx_home",
    "remove_stale",
    "remove_stand_ins",
    "scratch_dir",
    "writable_build_dir",
]

SCRATCH_PREFIX = ".build-"
# Older than any build or conversion takes (a few minutes at most), so a scratch directory
# this old was left by a process that died (kill -9, power loss): another process's
# directory is never removed under it, whichever PID namespace it runs in.
STALE_SECONDS = 3600.0

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_fallbacks: dict[Path, Path] = {}  # a cache directory that cannot be written -> its stand-in


def mtplx_home() -> Path:
    """``$MTPLX_HOME``, or ``~/.cache/mtplx`` when it is unset or empty."""
    home = os.environ.get("MTPLX_HOME")
    return Path(home) if home else Path.home() / ".cache" / "mtplx"


def calibration_dir() -> Path:
    """Where start-up calibrations are cached: ``$MTPLX_CALIBRATION_DIR``, or
    ``calibration`` under ``mtplx_home()`` when it is unset or empty. Apart from the home so
    that calibrations can be kept elsewhere while the kernels and the converted default model
    are shared (the test session keeps its own: its checkpoints are new every session)."""
    directory = os.environ.get("MTPLX_CALIBRATION_DIR")
    return Path(directory) if directory else mtplx_home() / "calibration"


def writable_build_dir(directory: Path) -> Path:
    """``directory`` (created where missing) when a file can be created in it; else this
    process's private temporary stand-in for it (made once, with one warning)."""
    with _lock:
        if directory in _fallbacks:
            return _fallbacks[directory]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
            return directory
        except OSError as exc:
            reason = exc.strerror or str(exc)
        stand_in = Path(tempfile.mkdtemp(prefix=f"mtplx-{directory.name}-"))  # mode 0700
        if not _fallbacks:
            atexit.register(remove_stand_ins)
        _fallbacks[directory] = stand_in
    logger.warning(
        "cannot write %s (%s): making what goes there in %s, for this run only (make "
        "MTPLX_HOME writable to make it once)",
        directory,
        reason,
        stand_in,
    )
    return stand_in


def build_target(target: Path) -> Path:
    """Where the library ``target`` is (when already built) or is to be built: ``target``
    itself, or the same name in this process's stand-in for its directory."""
    if target.exists():
        return target
    return writable_build_dir(target.parent) / target.name


def remove_stand_ins() -> None:
    """Remove this process's temporary build directories (a library loaded from one stays
    mapped). Runs at exit; ``mtplx serve``, which leaves through ``os._exit``, calls it."""
    with _lock:
        for stand_in in _fallbacks.values():
            shutil.rmtree(stand_in, ignore_errors=True)


def remove_stale(directory: Path, prefix: str) -> None:
    """Remove the entries of ``directory`` named ``prefix*`` that have not changed for
    ``STALE_SECONDS`` (nor has any file directly in them: a long write keeps its file's
    time fresh): scratch left by a process that died mid-build."""
    cutoff = time.time() - STALE_SECONDS
    try:
        entries = list(directory.glob(f"{prefix}*"))
    except OSError:
        return
    for entry in entries:
        try:
            if _last_change(entry) >= cutoff:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        except OSError:
            continue  # removed by another process meanwhile, or not ours to remove


def _last_change(entry: Path) -> float:
    """The newest modification time of ``entry`` and, for a directory, of its entries."""
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        for child in entry.iterdir():
            newest = max(newest, child.lstat().st_mtime)
    return newest


@contextmanager
def scratch_dir(directory: Path) -> Iterator[Path]:
    """A new private directory in ``directory`` for a build's intermediate files, removed
    when the block ends; stale ones (``remove_stale``) are removed first."""
    remove_stale(directory, SCRATCH_PREFIX)
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=directory) as scratch:
        yield Path(scratch)
