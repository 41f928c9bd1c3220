"""Statistics for the benchmark: medians and spreads, and speedups paired within a run.

A speedup is always a ratio of two runs that share the prompt, the sampler and the repeat
(they ran back to back, so a change in machine load between repeats hits both); the reported
speedup is the median of those per-pair ratios, not a ratio of medians.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spread:
    """Median and spread of a sample: min/max and the interquartile range."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    count: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "q1": self.q1,
            "q3": self.q3,
            "n": self.count,
        }


def median(values: Iterable[float]) -> float:
    """The median; NaN for an empty sample (a mode that never ran, not an error)."""
    data = [float(v) for v in values]
    return statistics.median(data) if data else float("nan")


def spread(values: Iterable[float]) -> Spread:
    """Median, min, max and quartiles (inclusive method: exact on 2 or 3 points)."""
    data = sorted(float(v) for v in values)
    if not data:
        nan = float("nan")
        return Spread(nan, nan, nan, nan, nan, 0)
    if len(data) == 1:
        q1 = q3 = data[0]
    else:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
    return Spread(statistics.median(data), data[0], data[-1], q1, q3, len(data))


def pair_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What two runs must share to be paired: sampler, category, prompt and repeat."""
    return (record["sampler"], record["category"], record["prompt_id"], record["repeat"])


def paired_speedups(
    records: Sequence[Mapping[str, Any]],
    baseline: str = "plain",
    metric: str = "decode_tps",
) -> dict[tuple[str, str, str], list[float]]:
    """``metric`` of each run over the baseline mode's in the same pair, grouped by
    (sampler, category, mode). Runs without a baseline partner are left out."""
    base = {pair_key(r): r[metric] for r in records if r["mode"] == baseline}
    ratios: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for record in records:
        reference = base.get(pair_key(record))
        if reference is None or reference <= 0:
            continue
        key = (record["sampler"], record["category"], record["mode"])
        ratios[key].append(record[metric] / reference)
    return dict(ratios)


def acceptance_per_position(
    accepted: Iterable[Sequence[int]], drafted: Iterable[Sequence[int]]
) -> list[float]:
    """Pooled acceptance rate at each draft position over several runs: sum accepted over
    sum drafted, position by position (a position never drafted is left off the end)."""
    acc_total: list[int] = []
    draft_total: list[int] = []
    for counts, total in ((accepted, acc_total), (drafted, draft_total)):
        for run in counts:
            total.extend([0] * (len(run) - len(total)))
            for position, value in enumerate(run):
                total[position] += int(value)
    return [(acc_total[i] if i < len(acc_total) else 0) / d for i, d in enumerate(draft_total) if d]


def pooled_acceptance_length(num_accepted: Iterable[int], num_cycles: Iterable[int]) -> float:
    """Tokens per verify forward over several runs: (accepted + cycles) / cycles."""
    accepted, cycles = sum(num_accepted), sum(num_cycles)
    return (accepted + cycles) / cycles if cycles else float("nan")
