"""How busy other processes keep this machine's CPUs over an interval.

A measurement of step costs taken while something else runs (a test suite, a second server
calibrating, a build) times the load, not the machine: the calibration uses this to decide
whether what it measured may be cached. Linux only (``/proc/stat``); elsewhere the load is
unknown (None) and callers treat the machine as their own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...;
# busy time is everything but idle and iowait (guest time is already inside user and nice).
# Steal is time the hypervisor gave other guests: load on the host, as slow for us as any.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative seconds at one moment: ``busy`` of all CPUs, ``own`` of this process
    (user + system, all threads), and the ``wall`` clock."""

    busy: float
    own: float
    wall: float


def busy_seconds(stat_text: str) -> float | None:
    """Seconds all CPUs have been busy since boot, from the text of ``/proc/stat``."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(value) for value in fields[1:]]
            if len(ticks) < 8:
                return None
            return sum(ticks[i] for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")
    return None


def snapshot() -> CpuSnapshot | None:
    """The machine's and this process's CPU time now; None where ``/proc/stat`` is not."""
    try:
        busy = busy_seconds(PROC_STAT.read_text())
    except (OSError, ValueError):
        return None
    if busy is None:
        return None
    own = os.times()
    return CpuSnapshot(busy, own.user + own.system, time.monotonic())


def background_load(start: CpuSnapshot | None, end: CpuSnapshot | None) -> float | None:
    """The share of the machine's CPUs (0: idle, 1: all of them) that processes other than
    this one kept busy between two snapshots; None when unknown."""
    if start is None or end is None or end.wall <= start.wall:
        return None
    others = (end.busy - start.busy) - (end.own - start.own)
    return max(others, 0.0) / ((end.wall - start.wall) * (os.cpu_count() or 1))
