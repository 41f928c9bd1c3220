"""The planner: draft source by match length, fixed and adaptive depths, batch pricing."""

from __future__ import annotations

import pytest

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import LookupFirstDrafter, NgramDrafter
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.drafters.ngram import LONG_MATCH
from mtplx.planner import (
    FILTERED,
    GREEDY,
    LONG_LOOKUP,
    SAMPLED,
    Plan,
    StepCosts,
    draft_source,
    make_policies,
    plan_cycle,
    sampling_kind,
)
from mtplx.request import SamplerConfig


class _ModelDrafter:
    name = "mtp"
    needs_hidden = False
    draft_vocab = None


def _policies(prior: dict[str, float]) -> dict[str, AdaptiveDepth]:
    # plain 50 ms, depth k 100 + 10k ms: lookup pays only where acceptance is high
    costs = [0.05] + [0.1 + 0.01 * k for k in range(1, 6)]
    return {key: AdaptiveDepth(costs, prior_acceptance=a) for key, a in prior.items()}


def test_lookup_is_planned_by_match_length() -> None:
    drafter = LookupFirstDrafter(NgramDrafter(), _ModelDrafter())  # type: ignore[arg-type]
    policies = _policies({LOOKUP: 0.3, LONG_LOOKUP: 0.8, "mtp": 0.3})
    text = list(range(100, 140))
    copying = [*text, 7, *text[:LONG_MATCH]]  # the output copies earlier text
    plan = plan_cycle(drafter, policies, None, copying, 64)
    assert plan == Plan(LONG_LOOKUP, 5) and draft_source(drafter, plan) == LOOKUP
    phrase = [*text, 7, *text[:3]]  # a short common match: lookup does not pay, nor mtp
    plan = plan_cycle(drafter, policies, None, phrase, 64)
    assert plan == Plan("mtp", 0) and draft_source(drafter, plan) is None
    # fixed depth: any match drafts from lookup
    assert plan_cycle(drafter, {}, 3, phrase, 64) == Plan(LOOKUP, 3)
    assert draft_source(drafter, Plan("mtp", 2)) == "mtp"


def test_plain_lookup_without_a_match_runs_a_plain_cycle() -> None:
    drafter = NgramDrafter()
    assert plan_cycle(drafter, {}, 4, list(range(100, 140)), 64) == Plan(None, 0)
    assert plan_cycle(drafter, {}, 4, [1, 2, 3, 1, 2], 64) == Plan(LOOKUP, 4)
    assert plan_cycle(drafter, {}, 4, [1, 2, 3, 1, 2], 2) == Plan(LOOKUP, 2)  # room left
    assert plan_cycle(None, {}, 4, [1, 2, 3, 1, 2], 64) == Plan(None, 0)


COSTS = StepCosts(
    batch_sizes=[1, 8],
    plain=[0.05, 0.10],
    per_token=[0.02, 0.08],
    sync=[0.01, 0.01],
    drafting={"mtp": [0.0, 0.005, 0.01, 0.015]},
)


def test_row_costs_price_a_row_within_its_batch() -> None:
    alone = COSTS.row_costs("mtp", 1, 3)
    expected = [0.05, 0.05 + 0.01 + 0.02 + 0.005, 0.05 + 0.01 + 0.04 + 0.01]
    assert alone == pytest.approx([*expected, 0.05 + 0.01 + 0.06 + 0.015])
    in_eight = COSTS.row_costs("ngram", 8, 2)  # lookup proposes for free
    assert in_eight == pytest.approx([0.10, 0.10 + 0.01 + 0.01, 0.10 + 0.01 + 0.02])
    halfway = COSTS.row_costs("ngram", 4, 1)  # interpolated between the measured sizes
    assert halfway[0] == pytest.approx(0.05 + 3 / 7 * 0.05)
    assert COSTS.row_costs(LONG_LOOKUP, 16, 1)[0] == 0.10  # held beyond the last size
    assert StepCosts(**COSTS.to_dict()) == COSTS


def test_drafting_gain_counts_the_close_and_requeue_steps() -> None:
    """Alone, a drafting episode saves the close step's forward (one plain step) and loses
    the requeue step's token: depth 1 pays only if E(1) - 1 beats its extra time."""
    costs = StepCosts([1], [0.1], [0.01], [0.01])
    gain = costs.drafting_gain("ngram", 1, [1.0, 1.5, 1.8])
    # E - 2 + (0.1 - (0.01 + k * 0.01)) * 10
    assert gain == pytest.approx([0.0, 1.5 - 2 + 0.8, 1.8 - 2 + 0.7])
    # In a batch of 8 the close step saves only this row's share of the step.
    costs = StepCosts([1, 8], [0.1, 0.17], [0.01, 0.08], [0.01, 0.01])
    assert costs.marginal_row(8) == pytest.approx(0.01)
    gain8 = costs.drafting_gain("ngram", 8, [1.0, 1.9])
    assert gain8[1] == pytest.approx(1.9 - 2 + (0.01 - 0.02) * 8 / 0.17)
    assert gain8[1] < 0 < gain[1]


def test_drafting_pays_less_in_a_full_batch() -> None:
    """The same acceptance drafts alone and stops drafting when the step it slows carries
    seven other rows' tokens."""
    costs = StepCosts([1, 8], [0.05, 0.12], [0.02, 0.16], [0.01, 0.02])
    drafter = NgramDrafter()
    history = [1, 2, 3, 1, 2]
    alone = {LOOKUP: AdaptiveDepth([1.0] * 6, prior_acceptance=0.8)}
    loaded = {LOOKUP: AdaptiveDepth([1.0] * 6, prior_acceptance=0.8)}
    assert plan_cycle(drafter, alone, None, history, 64, costs, batch_size=1).num_draft > 0
    assert plan_cycle(drafter, loaded, None, history, 64, costs, batch_size=8).num_draft == 0


def test_sources_that_run_ahead_pay_no_sync() -> None:
    """A source whose cycles run one step ahead reads no verdict before the next forward is
    built: its cycles cost the verified tokens and the proposing, not the synchronous step's
    extra; the others still pay it. ``ahead`` is the engine's, not cached with the measures."""
    measured = StepCosts([1], [0.06], [0.006], sync=[0.02], drafting={"mtp": [0.0, 0.007]})
    ahead = StepCosts(**{**measured.to_dict(), "ahead": ("mtp",)})
    assert measured.drafting_time("mtp", 1, 1) == pytest.approx(0.02 + 0.006 + 0.007)
    assert ahead.drafting_time("mtp", 1, 1) == pytest.approx(0.006 + 0.007)
    assert ahead.drafting_time(LOOKUP, 1, 1) == pytest.approx(0.02 + 0.006)
    assert "ahead" not in ahead.to_dict()


def test_a_drafting_line_below_zero_never_prices_a_cycle_below_a_shallower_one() -> None:
    """A model drafter's own line is below 0 where its cycles (run ahead) verify cheaper than
    lookup-verified tokens; in a batch, where each row's share of a verified token is smaller,
    a cycle still never adds less than nothing, nor less than a shallower cycle."""
    costs = StepCosts(
        [1, 8],
        [0.01, 0.03],
        [0.002, 0.004],
        drafting={"mtp": [0.0, -0.001, -0.003, -0.0025]},
        ahead=("mtp",),
    )
    assert costs.row_costs("mtp", 1, 3) == pytest.approx([0.01, 0.011, 0.011, 0.0135])
    assert costs.drafting_time("mtp", 8, 1) == 0.0  # 0.0005 - 0.001
    in_eight = [costs.drafting_time("mtp", 8, k) for k in range(4)]
    assert in_eight == sorted(in_eight) and min(in_eight) == 0.0


# A depth-1 MTP cycle 1.2 plain steps for a greedy row, 1.7 for a sampled one and 1.9 for a
# filtered one (as measured: a sampled verdict is dearer, a filter's sort dearer still);
# lookup's sampled cycles also dearer than its greedy ones.
PRICED = StepCosts(
    batch_sizes=[1, 8],
    plain=[0.01, 0.03],
    per_token=[0.001, 0.004],
    sync=[0.002, 0.002],
    drafting={"mtp": [0.0, 0.001, 0.003, 0.005]},
    sampled={"mtp": [0.0, 0.006, 0.01, 0.014], LOOKUP: [0.0, 0.002, 0.004, 0.006]},
    filtered={"mtp": [0.0, 0.008, 0.013, 0.018], LOOKUP: [0.0, 0.003, 0.006, 0.009]},
    ahead=("mtp",),
)


def test_a_rows_sampling_kind() -> None:
    assert sampling_kind(SamplerConfig(temperature=0.0, top_p=0.5)) == GREEDY
    assert sampling_kind(SamplerConfig(temperature=0.7)) == SAMPLED
    assert sampling_kind(SamplerConfig(temperature=1.0, presence_penalty=1.0)) == SAMPLED
    for filters in ({"top_p": 0.95}, {"top_k": 20}, {"min_p": 0.05}):
        assert sampling_kind(SamplerConfig(temperature=0.6, **filters)) == FILTERED  # type: ignore[arg-type]


def test_a_sampled_row_is_priced_by_its_sampled_cycles() -> None:
    greedy = PRICED.row_costs("mtp", 1, 3)
    assert greedy == pytest.approx([0.01, 0.012, 0.015, 0.018])  # the greedy line, as before
    unsampled = StepCosts(**{**PRICED.to_dict(), "sampled": {}, "filtered": {}, "ahead": ("mtp",)})
    assert unsampled.row_costs("mtp", 1, 3) == greedy  # the sampled lines move no greedy price
    sampled = PRICED.row_costs("mtp", 1, 3, SAMPLED)
    assert sampled == pytest.approx([0.01, 0.017, 0.022, 0.027])
    assert PRICED.row_costs("mtp", 1, 3, FILTERED) == pytest.approx([0.01, 0.019, 0.025, 0.031])
    # lookup: the greedy row's verifying alone, the sampled row's own line on top of it
    assert PRICED.row_costs(LOOKUP, 1, 2) == pytest.approx([0.01, 0.013, 0.014])
    assert PRICED.row_costs(LONG_LOOKUP, 1, 2, SAMPLED) == pytest.approx([0.01, 0.015, 0.018])
    # in a batch, the sampled verdict's extra stays the row's own (per row, not shared)
    in_eight = PRICED.drafting_time(LOOKUP, 8, 1, SAMPLED)
    assert in_eight == pytest.approx(0.002 + 0.004 / 8 + 0.002)
    # a source with no line of the row's kind: the next plainer kind's
    assert PRICED.row_costs("draft_model", 1, 1, FILTERED) == PRICED.row_costs("draft_model", 1, 1)
    no_filtered = StepCosts(**{**PRICED.to_dict(), "filtered": {}, "ahead": ("mtp",)})
    assert no_filtered.row_costs("mtp", 1, 3, FILTERED) == sampled


def _mtp_plan(policies: dict[str, AdaptiveDepth], sampling: str, batch_size: int = 1) -> Plan:
    drafter = LookupFirstDrafter(NgramDrafter(), _ModelDrafter())  # type: ignore[arg-type]
    no_match = list(range(100, 140))
    return plan_cycle(drafter, policies, None, no_match, 64, PRICED, batch_size, sampling)


def test_an_acceptance_that_pays_greedy_does_not_pay_sampled() -> None:
    """First-position acceptance 0.45: a depth-1 cycle of 1.2 plain steps pays, one of 1.7
    does not. Greedy rows draft as before; a sampled row stays plain."""
    policies = {kind: make_policies(_MTPFirst(), PRICED, 3, kind) for kind in (GREEDY, SAMPLED)}
    for kind, kind_policies in policies.items():
        kind_policies["mtp"].prior_acceptance = 0.45
        assert kind_policies["mtp"].cycle_cost == pytest.approx(PRICED.row_costs("mtp", 1, 3, kind))
    assert _mtp_plan(policies[GREEDY], GREEDY).num_draft > 0
    assert _mtp_plan(policies[SAMPLED], SAMPLED) == Plan("mtp", 0)
    # at a high acceptance a sampled row drafts too
    policies[SAMPLED]["mtp"].prior_acceptance = 0.9
    assert _mtp_plan(policies[SAMPLED], SAMPLED).num_draft > 0


def test_a_mixed_batch_prices_each_row_by_its_own_kind() -> None:
    """A greedy and a sampled row in one step of 2, the same acceptance (0.9: in a batch of
    2 a cycle must pay for the other row's wait too): each row priced by its own kind."""
    plans = {}
    for kind in (GREEDY, SAMPLED):
        policies = make_policies(_MTPFirst(), PRICED, 3, kind)
        policies["mtp"].prior_acceptance = 0.9
        plans[kind] = _mtp_plan(policies, kind, batch_size=2)
    assert plans[GREEDY].num_draft > 0 and plans[SAMPLED] == Plan("mtp", 0)


class _MTPFirst(LookupFirstDrafter):
    """Lookup first, then the model drafter: its depth policy keys without a real head."""

    def __init__(self) -> None:
        super().__init__(NgramDrafter(), _ModelDrafter())  # type: ignore[arg-type]
