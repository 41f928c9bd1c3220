"""Build caches where ``MTPLX_HOME`` cannot be written: a private stand-in for the run."""

from __future__ import annotations

import stat
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
