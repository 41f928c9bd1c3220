"""Build caches where ``MTPLX_HOME`` cannot be written: a private stand-in for the run; where
calibrations are cached."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from mtplx import build_dirs


def test_a_writable_cache_directory_is_used_and_made(tmp_path: Path) -> None:
    directory = tmp_path / "home" / "quant"
    assert build_dirs.writable_build_dir(directory) == directory
    assert directory.is_dir()


def test_an_unwritable_one_gets_one_private_stand_in_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(build_dirs, "_fallbacks", {})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = blocker / "home" / "quant"  # below a file: cannot be made
    with caplog.at_level("WARNING", logger="mtplx.build_dirs"):
        stand_in = build_dirs.writable_build_dir(directory)
        assert build_dirs.writable_build_dir(directory) == stand_in  # asked again: the same
    assert stand_in.is_dir() and stand_in != directory
    assert stat.S_IMODE(stand_in.stat().st_mode) == 0o700  # nobody else can plant a library
    assert len(caplog.records) == 1 and str(directory) in caplog.text
    (stand_in / "lib.so").write_bytes(b"")
    build_dirs.remove_stand_ins()
    assert not stand_in.exists()


def test_calibrations_are_kept_in_their_own_directory_where_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MTPLX_CALIBRATION_DIR", raising=False)
    assert build_dirs.calibration_dir() == tmp_path / "home" / "calibration"
    monkeypatch.setenv("MTPLX_CALIBRATION_DIR", "")  # empty: as unset
    assert build_dirs.calibration_dir() == tmp_path / "home" / "calibration"
    monkeypatch.setenv("MTPLX_CALIBRATION_DIR", str(tmp_path / "elsewhere"))
    assert build_dirs.calibration_dir() == tmp_path / "elsewhere"


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_scratch_a_killed_build_left_is_removed_by_the_next_build(tmp_path: Path) -> None:
    stale = tmp_path / f"{build_dirs.SCRATCH_PREFIX}dead"
    stale.mkdir()
    (stale / "k.o").write_bytes(b"\0" * 64)
    _age(stale / "k.o", build_dirs.STALE_SECONDS + 60)
    _age(stale, build_dirs.STALE_SECONDS + 60)
    fresh = tmp_path / f"{build_dirs.SCRATCH_PREFIX}running"  # another process's, mid-build
    fresh.mkdir()
    other = tmp_path / "tmp-not-ours"
    other.mkdir()
    _age(other, build_dirs.STALE_SECONDS + 60)
    with build_dirs.scratch_dir(tmp_path) as scratch:
        assert scratch.parent == tmp_path and scratch.name.startswith(build_dirs.SCRATCH_PREFIX)
        (scratch / "lib.so").write_bytes(b"")
        assert not stale.exists()
        assert fresh.is_dir() and other.is_dir()
    assert not scratch.exists()


def test_stale_scratch_with_a_file_still_being_written_is_kept(tmp_path: Path) -> None:
    converting = tmp_path / ".model.tmp-abc"
    converting.mkdir()
    (converting / "model.safetensors").write_bytes(b"")  # written to a moment ago
    _age(converting, build_dirs.STALE_SECONDS + 60)
    build_dirs.remove_stale(tmp_path, ".model.tmp-")
    assert converting.is_dir()
    _age(converting / "model.safetensors", build_dirs.STALE_SECONDS + 60)
    build_dirs.remove_stale(tmp_path, ".model.tmp-")
    assert not converting.exists()
