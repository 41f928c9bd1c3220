"""Adaptive draft depth: pick the number of draft tokens per cycle that maximises expected
committed tokens per second, from measured acceptance and measured cycle cost, down to 0
(plain decoding) when speculation does not pay.

With a_j the chance that draft position j is accepted given positions < j were, a cycle of
depth K commits on average ``E(K) = 1 + sum_{j<=K} prod_{i<=j} a_i`` tokens and costs
``cost(K)``; the policy picks ``argmax_K E(K) / cost(K)``. The choice depends only on the
request's own acceptance counts and the engine's cost table, so a seeded request replays the
same schedule (and output) in the same process.

Choosing, the policy is optimistic about the first draft position: it takes ``a_1`` at an
upper confidence bound (``optimism`` posterior standard deviations above the mean), so a few
early rejections do not stop a drafter whose acceptance is above break-even (plain cycles
teach the policy nothing, and probes come rarely); once the counts are many, the bound is
near the mean and a drafter below break-even stops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class AdaptiveDepth:
    """Per-request depth chooser. ``cycle_cost[K]``: seconds of one cycle of depth K."""

    def __init__(
        self,
        cycle_cost: Sequence[float],
        prior_acceptance: float = 0.5,
        prior_weight: float = 4.0,
        decay: float = 0.97,
        probe_interval: int = 16,
        probe_budget: float = 0.02,
        optimism: float = 0.5,
    ) -> None:
        if len(cycle_cost) < 1 or any(c <= 0 for c in cycle_cost):
            raise ValueError("cycle_cost needs a positive cost for depth 0 and up")
        self.cycle_cost = list(cycle_cost)
        self.max_depth = len(cycle_cost) - 1
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_interval = probe_interval  # the fewest plain cycles between probes
        self.probe_budget = probe_budget  # the share of decode time probes may lose
        self.optimism = optimism  # posterior standard deviations added to a_1 when choosing
        # Decayed counts per draft position: how often it was tested and accepted.
        self.tested = [0.0] * self.max_depth
        self.accepted = [0.0] * self.max_depth
        self.plain_cycles = 0  # since the last probe

    def acceptance(self, position: int) -> float:
        """Estimated acceptance of draft position ``position`` (0-based) given the earlier
        ones were accepted: a Beta-prior mean over decayed counts."""
        prior = self.prior_weight
        return (self.accepted[position] + prior * self.prior_acceptance) / (
            self.tested[position] + prior
        )

    def acceptance_bound(self, position: int) -> float:
        """``acceptance(position)`` plus ``optimism`` standard deviations of its Beta
        posterior (at most 1)."""
        prior = self.prior_weight
        passed = self.accepted[position] + prior * self.prior_acceptance
        failed = (
            self.tested[position] - self.accepted[position] + prior * (1 - self.prior_acceptance)
        )
        total = passed + failed
        deviation = math.sqrt(passed * failed / (total * total * (total + 1)))
        return min(passed / total + self.optimism * deviation, 1.0)

    def expected_tokens(self, depth: int, optimistic: bool = False) -> float:
        """E(depth): expected committed tokens of one cycle (``optimistic``: with the first
        position's acceptance at its upper bound, as ``choose`` prices it)."""
        total, survive = 1.0, 1.0
        for position in range(depth):
            if optimistic and position == 0:
                survive *= self.acceptance_bound(position)
            else:
                survive *= self.acceptance(position)
            total += survive
        return total

    def choose(
        self,
        limit: int | None = None,
        cycle_cost: Sequence[float] | None = None,
        other_tokens: float = 0.0,
    ) -> int:
        """The depth for the next cycle, at most ``limit``. ``cycle_cost`` replaces the
        policy's own costs for this choice (a batch step's cost as a function of this row's
        depth), and ``other_tokens`` is what the rest of the batch commits in that step: the
        policy then maximises the step's tokens per second, not this row's alone."""
        costs = self.cycle_cost if cycle_cost is None else list(cycle_cost)
        max_depth = min(self.max_depth, len(costs) - 1)
        if limit is not None:
            max_depth = min(max_depth, limit)
        rates = [
            (self.expected_tokens(k, optimistic=True) + other_tokens) / costs[k]
            for k in range(max_depth + 1)
        ]
        best = max(range(max_depth + 1), key=rates.__getitem__)
        if best == 0:
            return self.probe(max_depth, costs, other_tokens)
        return best

    def probe(
        self, max_depth: int, cycle_cost: Sequence[float] | None = None, other_tokens: float = 0.0
    ) -> int:
        """0 (a plain cycle), or 1 when a probe is due: a plain cycle is counted, and every
        ``plain_cycles_per_probe`` of them one depth-1 cycle keeps measuring acceptance, so
        a drafter that starts to pay is noticed."""
        if max_depth <= 0:
            return 0
        self.plain_cycles += 1
        interval = self.plain_cycles_per_probe(cycle_cost, other_tokens)
        if interval is not None and self.plain_cycles >= interval:
            self.plain_cycles = 0
            return 1
        return 0

    def plain_cycles_per_probe(
        self, cycle_cost: Sequence[float] | None = None, other_tokens: float = 0.0
    ) -> int | None:
        """How many plain cycles pass between depth-1 probes: at least ``probe_interval``,
        and as many as it takes for a probe's expected loss (its cost over plain decoding's
        cost for the tokens it is expected to commit) to stay within ``probe_budget`` of the
        decode time. None: no probing, since no depth would pay even if every draft token
        were accepted."""
        costs = self.cycle_cost if cycle_cost is None else list(cycle_cost)
        plain = costs[0]
        depths = range(1, min(self.max_depth, len(costs) - 1) + 1)
        base = 1 + other_tokens
        if all((k + base) / costs[k] <= base / plain for k in depths):
            return None
        per_token = plain / base
        loss = costs[1] - per_token * (self.expected_tokens(1) + other_tokens)
        return max(self.probe_interval, math.ceil(loss / (self.probe_budget * per_token)))

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record a cycle: positions 0..num_accepted were tested, 0..num_accepted-1 passed."""
        for position in range(self.max_depth):
            self.tested[position] *= self.decay
            self.accepted[position] *= self.decay
        for position in range(min(num_drafted, num_accepted + 1)):
            self.tested[position] += 1.0
            self.accepted[position] += position < num_accepted
