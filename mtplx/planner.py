"""The planner: for every running sequence, the draft source and depth of its next cycle.

Pure functions of a sequence's history, its depth policies and the step cost model; no side
effects on drafters (the engine applies a plan). The cost model prices a batch step: plain
decoding of B rows costs ``plain[B]``; a row that verifies k draft tokens adds its share of
the longer forward and its own drafting time (see ``StepCosts.row_costs``). A row that samples
(temperature > 0) is priced by what a sampled row's cycles cost against its sampled plain steps
(``StepCosts.sampled``; with a filter, ``StepCosts.filtered``), a greedy row by the greedy
cycles: each row by its own kind (``sampling_kind``), also in a batch that mixes kinds, since a
sampled verdict's extra is the row's own.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import Drafter
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.drafters.ngram import LONG_MATCH
from mtplx.request import SamplerConfig

# Lookup cycles whose match is LONG_MATCH tokens or more, a copy of earlier text, get their
# own depth policy: their acceptance is high (see mtplx.drafters.ngram), that of short
# matches (common phrases) low, so one estimate for both would fit neither.
LONG_LOOKUP = "ngram-long"

# Prior acceptance per depth policy, before a request has measured its own: for a model
# drafter, what the shipped head achieves at position 1 on the bench's chat and code prompts
# (0.25-0.31; 0.49 on prompts like its training data), which does not pay on a CPU, so a
# request drafts only once its own counts show it pays; for copied text, what lookup
# achieves there, so a request starts drafting on the first long match.
PRIOR_ACCEPTANCE = {"mtp": 0.3, "draft_model": 0.3, LOOKUP: 0.3, LONG_LOOKUP: 0.8}

# How a row samples, as its cycles are priced (``sampling_kind``).
GREEDY = "greedy"
SAMPLED = "sampled"
FILTERED = "filtered"


def sampling_kind(config: SamplerConfig) -> str:
    """``GREEDY`` (temperature 0: the verdict is an argmax), ``SAMPLED`` (the verdict and a
    plain step take the target's distribution) or ``FILTERED`` (sampled with top-p, top-k or
    min-p: a sort or partition over the vocabulary at every position on top)."""
    if config.is_greedy:
        return GREEDY
    if config.top_p < 1.0 or config.top_k > 0 or config.min_p > 0.0:
        return FILTERED
    return SAMPLED


@dataclass(frozen=True)
class Plan:
    """One sequence's next cycle: ``source`` is the depth policy key (None: no drafter)."""

    source: str | None
    num_draft: int


@dataclass
class StepCosts:
    """Seconds of a batch step, measured at start-up (``mtplx.calibration``).

    ``batch_sizes``: the measured batch sizes, ascending; ``plain[i]``: a plain step of
    ``batch_sizes[i]`` rows (queued one step ahead); ``sync[i]``: what a step costs more when
    any row drafts (it must read its verdict: nothing is queued ahead); ``per_token[i]``:
    what one more verified token of every row adds (a lookup draft, free to propose);
    ``drafting[source][k]``: what one row's cycle of k drafts from a model drafter costs beyond
    the verifying that ``sync`` and ``per_token`` price (proposing, the drafter's commit);
    negative where its cycles verify cheaper than lookup rows do (a cycle run one step ahead
    overlaps its verifying with building the next step: at batch 1 its whole extra can be
    below one lookup-verified token's). ``ahead``: the draft sources whose cycles run one
    step ahead (the engine's, not measured): they read no verdict before the next forward
    is built, so pay no ``sync``.

    ``sampled[source][k]``: the ``drafting`` line of a row that samples (``SAMPLED``), for
    the model drafters and for lookup (``"ngram"``): its cycle measured against its own
    sampled plain steps (a sampled verdict, the target's distribution at every position, costs
    more than a greedy one, and a sampled plain step more than a greedy one), as a share of
    the calibration's plain step, less the same verifying charge; ``filtered[source][k]``:
    the same for a row that samples with a filter (``FILTERED``). A source without a line
    of its row's kind prices it as the next plainer kind (filtered, sampled, greedy)."""

    batch_sizes: list[int]
    plain: list[float]
    per_token: list[float]
    sync: list[float] = field(default_factory=list)
    drafting: dict[str, list[float]] = field(default_factory=dict)
    sampled: dict[str, list[float]] = field(default_factory=dict)
    filtered: dict[str, list[float]] = field(default_factory=dict)
    ahead: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """JSON-ready measured fields (the calibration cache)."""
        measured = asdict(self)
        del measured["ahead"]
        return measured

    def _at(self, values: Sequence[float], batch_size: int) -> float:
        """Linear interpolation over the measured batch sizes (held at the ends)."""
        sizes = self.batch_sizes
        if not values:
            return 0.0
        if batch_size <= sizes[0]:
            return values[0]
        if batch_size >= sizes[-1]:
            return values[-1]
        i = bisect.bisect_left(sizes, batch_size)
        lo, hi = sizes[i - 1], sizes[i]
        weight = (batch_size - lo) / (hi - lo)
        return values[i - 1] + weight * (values[i] - values[i - 1])

    def row_costs(
        self, source: str, batch_size: int, max_depth: int, sampling: str = GREEDY
    ) -> list[float]:
        """A steady step's cost for depth 0..max_depth of one row among ``batch_size``, the
        other rows plain: the plain step; when drafting, plus the synchronous step's extra,
        this row's share of k more tokens per row, and its drafting time (``sampling``: how
        the row samples, ``sampling_kind``)."""
        plain = self._at(self.plain, batch_size)
        return [plain] + [
            plain + self.drafting_time(source, batch_size, k, sampling)
            for k in range(1, max_depth + 1)
        ]

    def drafting_time(
        self, source: str, batch_size: int, depth: int, sampling: str = GREEDY
    ) -> float:
        """What one row drafting ``depth`` tokens adds to a step of ``batch_size`` rows: the
        synchronous step's extra (not for a source run ahead), its share of the verified
        tokens and its drafting (the line of the row's ``sampling`` kind where one was
        measured); never below 0 nor below a shallower cycle's."""
        sync = 0.0 if source in self.ahead else self._at(self.sync, batch_size)
        per_token = self._at(self.per_token, batch_size) / batch_size
        key = _cost_source(source)
        drafting = self.drafting.get(key, [0.0])
        if sampling in (SAMPLED, FILTERED):
            drafting = self.sampled.get(key, drafting)
        if sampling == FILTERED:
            drafting = self.filtered.get(key, drafting)
        own = [drafting[min(k, len(drafting) - 1)] for k in range(depth + 1)]
        return max([0.0, *(sync + k * per_token + own[k] for k in range(1, depth + 1))])

    def marginal_row(self, batch_size: int) -> float:
        """What one more plain row adds to a step of ``batch_size`` rows."""
        if batch_size <= 1 or len(self.batch_sizes) == 1:
            return self._at(self.plain, 1) if batch_size <= 1 else 0.0
        below = self._at(self.plain, batch_size - 1)
        return max(self._at(self.plain, batch_size) - below, 0.0)

    def drafting_gain(
        self, source: str, batch_size: int, expected: Sequence[float], sampling: str = GREEDY
    ) -> list[float]:
        """Tokens gained (the batch's plain rate converts time to tokens) by one row drafting
        k tokens once amid plain steps, for each k (entry 0 is 0.0); ``expected[k]``: the
        tokens a cycle of depth k commits (E(k)); ``sampling``: how the row samples.

        Such a row first commits its queued token without feeding the forward (it saves the
        batch its marginal row time), verifies k drafts in one step (committing E(k) instead
        of 1, at the cost of ``drafting_time``), then queues its next forward again, which
        commits nothing that step: E(k) - 2 tokens more, for the time difference."""
        plain = self._at(self.plain, batch_size)
        rate = batch_size / plain  # the batch's tokens per second
        saved = self.marginal_row(batch_size)
        return [0.0] + [
            expected[k] - 2 + (saved - self.drafting_time(source, batch_size, k, sampling)) * rate
            for k in range(1, len(expected))
        ]


def sources(drafter: Drafter | None) -> tuple[str, ...]:
    """The depth policy keys of a drafter: one per draft source, and lookup's split by match
    length (see ``plan_cycle``)."""
    if drafter is None:
        return ()
    keys: tuple[str, ...] = ()
    for source in drafter.sources:
        keys += (LOOKUP, LONG_LOOKUP) if source == LOOKUP else (source,)
    return keys


def _model_source(drafter: Drafter) -> str | None:
    """The model drafter a drafter drafts with when it does not look up (None: only lookup)."""
    return next((source for source in drafter.sources if source != LOOKUP), None)


def _cost_source(source: str) -> str:
    """The draft source whose drafting cost a depth policy key uses."""
    return LOOKUP if source == LONG_LOOKUP else source


def make_policies(
    drafter: Drafter | None, costs: StepCosts, max_depth: int, sampling: str = GREEDY
) -> dict[str, AdaptiveDepth]:
    """A fresh adaptive depth policy per draft source of ``drafter``, priced alone, at the
    costs of a row that samples as ``sampling`` says (``sampling_kind``)."""
    return {
        source: AdaptiveDepth(
            costs.row_costs(source, 1, max_depth, sampling),
            prior_acceptance=PRIOR_ACCEPTANCE[source],
        )
        for source in sources(drafter)
    }


def plan_cycle(
    drafter: Drafter | None,
    policies: Mapping[str, AdaptiveDepth],
    depth: int | None,
    history: list[int],
    limit: int,
    costs: StepCosts | None = None,
    batch_size: int = 1,
    sampling: str = GREEDY,
) -> Plan:
    """The next cycle of one sequence, at most ``limit`` draft tokens. Prompt lookup drafts
    when the history has an n-gram match and the policy for that kind of match (long: a copy
    of earlier text, or short) gives a depth above 0; otherwise a lookup-first drafter drafts
    from its model drafter and plain lookup does not draft. With ``policies`` (adaptive
    depth) and ``costs``, depths are priced in a step of ``batch_size`` rows, at the costs
    of a row that samples as ``sampling`` says (``sampling_kind`` of the sequence's sampler)."""
    if drafter is None:
        return Plan(None, 0)

    def depth_for(source: str) -> int:
        if not policies:
            return min(depth or 0, limit)
        policy = policies[source]
        if costs is None:
            return policy.choose(limit)
        max_depth = min(policy.max_depth, limit)
        expected = [policy.expected_tokens(k, optimistic=True) for k in range(max_depth + 1)]
        gains = costs.drafting_gain(source, batch_size, expected, sampling)
        best = max(range(max_depth + 1), key=gains.__getitem__)
        return best if best > 0 else policy.probe(max_depth)

    if LOOKUP in drafter.sources and (match := drafter.match_length(history)):
        source = LONG_LOOKUP if match >= LONG_MATCH else LOOKUP
        if (num_draft := depth_for(source)) > 0:
            return Plan(source, num_draft)
    model = _model_source(drafter)
    return Plan(None, 0) if model is None else Plan(model, depth_for(model))


def draft_source(drafter: Drafter | None, plan: Plan) -> str | None:
    """The draft source a drafter of several sources (lookup-first) must ``use`` for
    ``plan``; None when it has one source or the plan drafts nothing."""
    if drafter is None or len(drafter.sources) < 2 or plan.num_draft == 0:
        return None
    return LOOKUP if plan.source in (LOOKUP, LONG_LOOKUP) else _model_source(drafter)
