"""Other processes' share of the CPUs, from /proc/stat and this process's own times."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mtplx import host_load
from mtplx.host_load import CpuSnapshot, background_load, busy_seconds

STAT = """cpu  600 100 200 5000 40 0 20 30 0 0
cpu0 300 50 100 2500 20 0 10 15 0 0
intr 12345
"""


def test_busy_seconds_counts_all_but_idle_and_iowait() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(STAT) == pytest.approx((600 + 100 + 200 + 0 + 20 + 30) / hz)
    assert busy_seconds("intr 1\n") is None
    assert busy_seconds("cpu 1 2 3\n") is None  # too few fields to trust


def test_background_load_is_the_others_share_of_all_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    start = CpuSnapshot(busy=100.0, own=10.0, wall=1000.0)
    # 10 s on 2 CPUs: 12 s busy, 4 of them ours -> others kept 8 of 20 CPU-seconds busy
    assert background_load(start, CpuSnapshot(112.0, 14.0, 1010.0)) == pytest.approx(0.4)
    # only we ran (rounding can make others' time negative): no load
    assert background_load(start, CpuSnapshot(104.0, 14.5, 1010.0)) == 0.0
    assert background_load(None, start) is None
    assert background_load(start, start) is None  # no time passed


@pytest.mark.skipif(not host_load.PROC_STAT.exists(), reason="/proc/stat is Linux's")
def test_a_busy_thread_of_another_process_shows_as_load() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        before = host_load.snapshot()
        time.sleep(1.0)
        load = background_load(before, host_load.snapshot())
    finally:
        spinner.kill()
        spinner.wait()
    assert load is not None
    # one of cpu_count CPUs busy (more if the machine is busy otherwise)
    assert load >= 0.7 / (os.cpu_count() or 1)
