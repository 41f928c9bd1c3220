"""mlx-lm imported through ``mtplx.file_limits``: the open-file limits are raised within the
hard limit, never lowered, and the import works under a hard limit below mlx-lm's 4,096."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from mtplx.file_limits import soft_limit_within_hard

IMPORT_AND_REPORT = """
import resource
from mtplx.file_limits import import_mlx_lm
import_mlx_lm()
import mlx_lm
print(*resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def _limits_after_import(soft: int, hard: int) -> tuple[int, int]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", IMPORT_AND_REPORT],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    new_soft, new_hard = map(int, done.stdout.split())
    return new_soft, new_hard


def test_import_under_a_hard_limit_below_mlx_lms_request_works() -> None:
    # mlx-lm's own setrlimit((2048, 4096)) raises ValueError here for an unprivileged process
    # and silently raises the hard limit for root; either way the hard limit must stay.
    assert _limits_after_import(1024, 3000) == (2048, 3000)


def test_a_higher_hard_limit_is_kept() -> None:
    # conftest imports mlx-lm through mtplx.file_limits too, so this process's hard limit is
    # still the one it started with.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if hard <= 4096:
        pytest.fail(f"needs a hard open-file limit above 4096, found {hard}")
    assert _limits_after_import(1024, hard) == (2048, hard)


def test_a_higher_soft_limit_is_kept() -> None:
    assert _limits_after_import(4000, 4000) == (4000, 4000)


def test_soft_limit_within_hard_never_lowers() -> None:
    calls: list[tuple[int, tuple[int, int]]] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_limit_within_hard(1, lambda which, limits: calls.append((which, limits)))
    assert calls == []
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        soft_limit_within_hard(soft + 1, lambda which, limits: calls.append((which, limits)))
        assert calls == [(resource.RLIMIT_NOFILE, (soft + 1, hard))]
