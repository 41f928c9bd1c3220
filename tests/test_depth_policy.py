"""The adaptive depth policy."""

from __future__ import annotations

import pytest

from mtplx.depth_policy import AdaptiveDepth

# A verify of K+1 tokens costs a little more than one token; drafting is cheap.
COSTS = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def _drive(policy: AdaptiveDepth, acceptance: float, cycles: int = 200) -> list[int]:
    """Simulate cycles where each draft position passes with the given rate (deterministic
    pattern: the expected number of leading acceptances)."""
    chosen = []
    credit = 0.0
    for _ in range(cycles):
        depth = policy.choose()
        chosen.append(depth)
        accepted = 0
        for _ in range(depth):
            credit += acceptance
            if credit >= 1.0:
                credit -= 1.0
                accepted += 1
            else:
                break
        if depth:
            policy.update(depth, accepted)
    return chosen


def test_high_acceptance_drafts_deep() -> None:
    chosen = _drive(AdaptiveDepth(COSTS), acceptance=0.95)
    assert sum(chosen[-50:]) / 50 >= 4


def test_useless_drafter_falls_back_to_plain_decoding_with_rare_probes() -> None:
    # Break-even here is 0.1: the optimistic bound on a_1 falls below it after ~40 rejected
    # cycles (the decayed counts hold ~33 cycles, so the bound never collapses at once).
    policy = AdaptiveDepth(COSTS, probe_interval=16)
    chosen = _drive(policy, acceptance=0.0, cycles=300)
    assert 0 not in chosen[:30]
    tail = chosen[-200:]
    assert tail.count(0) >= 185 and set(tail) <= {0, 1}


def test_the_bound_on_the_first_position_shrinks_with_the_counts() -> None:
    policy = AdaptiveDepth(COSTS, prior_acceptance=0.3, prior_weight=4.0, optimism=1.0)
    assert policy.acceptance(0) == pytest.approx(0.3)
    # Beta(1.2, 2.8): mean 0.3, standard deviation sqrt(1.2 * 2.8 / (16 * 5))
    assert policy.acceptance_bound(0) == pytest.approx(0.3 + (1.2 * 2.8 / 80) ** 0.5)
    widths = []
    for _ in range(3):
        for _ in range(10):
            policy.update(1, 0)
            policy.update(1, 1)
            policy.update(1, 0)
            policy.update(1, 0)
        widths.append(policy.acceptance_bound(0) - policy.acceptance(0))
    assert widths[0] > widths[1] > widths[2] > 0
    assert AdaptiveDepth(COSTS, optimism=0.0).acceptance_bound(0) == pytest.approx(0.5)


def test_an_unlucky_start_does_not_stop_a_drafter_above_break_even() -> None:
    """Depth 1 costs 1.18 plain cycles (break-even acceptance 0.18); the drafter's first four
    drafts fail, then one in four passes (0.25). Priced at the mean, the policy stops after
    the streak and drafts again only once a probe passes (16 plain cycles on); at the bound
    it keeps drafting."""
    costs = [1.0, 1.18]

    def drafted(optimism: float | None) -> int:
        policy = AdaptiveDepth(costs, prior_acceptance=0.3)  # the default optimism
        if optimism is not None:
            policy.optimism = optimism
        outcomes = [0, 0, 0, 0] + [1, 0, 0, 0] * 20
        count = 0
        for _ in range(80):
            if policy.choose():
                policy.update(1, outcomes[count])
                count += 1
        return count

    assert drafted(0.0) <= 55
    assert drafted(None) == 80


def test_expensive_drafting_needs_more_acceptance() -> None:
    cheap = AdaptiveDepth([1.0, 1.1, 1.2])
    dear = AdaptiveDepth([1.0, 2.0, 3.0])
    for policy in (cheap, dear):
        for _ in range(50):
            policy.update(2, 1)  # position 1 passes, position 2 fails
    assert cheap.choose() >= 1 and dear.choose() == 0


def test_limit_caps_depth() -> None:
    policy = AdaptiveDepth(COSTS, prior_acceptance=0.99)
    assert policy.choose(limit=2) == 2
    assert policy.choose(limit=0) == 0


def test_expected_tokens_formula() -> None:
    policy = AdaptiveDepth([1.0, 1.0, 1.0], prior_acceptance=0.5, prior_weight=1.0)
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)


def test_invalid_costs_rejected() -> None:
    with pytest.raises(ValueError, match="cycle_cost"):
        AdaptiveDepth([])


def test_probes_are_rarer_the_more_they_lose() -> None:
    cheap = AdaptiveDepth(COSTS, probe_interval=16, probe_budget=0.02)
    assert cheap.plain_cycles_per_probe() == 16  # a probe loses nothing here
    # A depth-1 cycle costing 2.8 plain ones that commits 1 + 0.45 tokens on average loses
    # 1.35 plain cycles; at 2% of the time that is one probe per 68 plain cycles.
    dear = AdaptiveDepth([1.0, 2.8, 3.0, 3.2], prior_acceptance=0.45, probe_budget=0.02)
    assert dear.plain_cycles_per_probe() == 68
    chosen = _drive(dear, acceptance=0.0, cycles=400)
    assert 2 <= chosen.count(1) <= 400 // 68 and set(chosen) <= {0, 1}


def test_no_probes_when_no_depth_could_ever_pay() -> None:
    # Even with every draft accepted, depth K commits K + 1 tokens for more than K + 1
    # plain cycles' time.
    hopeless = AdaptiveDepth([1.0, 2.5, 3.5, 4.5], prior_acceptance=0.45)
    assert hopeless.plain_cycles_per_probe() is None
    assert set(_drive(hopeless, acceptance=1.0, cycles=300)) == {0}
