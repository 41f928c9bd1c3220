"""The planner: draft source by match length, fixed and adaptive depths, batch pricing."""

from __future__ import annotations

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import LookupFirstDrafter, NgramDrafter
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.drafters.ngram import LONG_MATCH
from mtplx.planner import LONG_LOOKUP, Plan, StepCosts, draft_source, plan_cycle


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
    assert alone == [
        0.05,
        0.05 + 0.01 + 0.02 + 0.005,
        0.05 + 0.01 + 0.04 + 0.01,
        0.05 + 0.01 + 0.06 + 0.015,
    ]
    in_eight = COSTS.row_costs("ngram", 8, 2)  # lookup proposes for free
    assert in_eight == [0.10, 0.10 + 0.01 + 0.01, 0.10 + 0.01 + 0.02]
    halfway = COSTS.row_costs("ngram", 4, 1)  # interpolated between the measured sizes
    assert abs(halfway[0] - (0.05 + 3 / 7 * 0.05)) < 1e-12
    assert COSTS.row_costs(LONG_LOOKUP, 16, 1)[0] == 0.10  # held beyond the last size
    assert StepCosts(**COSTS.to_dict()) == COSTS


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
