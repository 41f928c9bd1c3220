"""Timing an engine's steps on scratch sequences: the measuring behind the start-up
calibration (``mtplx.calibration``), which caches what ``calibrate`` returns.

Steps are timed on scratch sequences through the engine's own step loop, in blocks: a few
steps that switch the rows to a depth (closing queued work, filling the pipeline) untimed,
then the median of a few steady ones. Every drafting depth's block lies between two plain
blocks of the same rows, and is priced by its ratio to them (the depths' order rotating
every round; medians over rounds): a shared host's slow spell (+-15% quiet, 2x under load)
slows every step alike, so it weighs on both sides of a ratio, where separate medians would
mix quiet and busy blocks. For each batch size B, B scratch rows switch between plain
decoding (every row one queued token, as the engine runs them) and verifying k lookup
drafts (a scratch lookup that always proposes k tokens, proposing for free); a lookup step's
cost is a line in k fitted through its depths (intercept: the extra of a step that must read
its verdicts; slope: one more verified token per row). A model drafter's cycles are timed
as the engine runs them: one row drafting from it at each depth, against its own plain
steps; each depth is priced from its own ratio (``drafting_costs``: a line through all
depths let a slow depth-4 block misprice the depth-1 cycle chat drafts with), as that share
of the calibration's plain step, less what the cost model already charges for verifying.

A row that samples (temperature > 0) costs more than a greedy one both ways: its plain step
draws from a softmax over the vocabulary, its verdict takes the target's distribution at every
verified position (where a greedy verdict is an argmax); a filter (top-p, top-k, min-p) adds a
sort or partition over the vocabulary at every position. The planner sets a sampled row's
cycle against its sampled plain step, so for each kind of sampled row (``SAMPLERS``: without
and with a filter) each model drafter's cycles, and lookup's (one row at depths 1 and 4), are
timed again with the row sampling so, against its own plain steps, priced the same paired way
(``StepCosts.sampled``, ``StepCosts.filtered``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mtplx.drafters.lookup_first import LOOKUP
from mtplx.drafters.ngram import NgramDrafter, find_continuation
from mtplx.planner import FILTERED, SAMPLED, StepCosts
from mtplx.request import GenerationRequest, SamplerConfig

if TYPE_CHECKING:
    from mtplx.models.base import LoadedModel
    from mtplx.models.rows import BatchedTarget
    from mtplx.sequence import Sequence


class Engine(Protocol):
    """What calibration drives: the parts of ``mtplx.engine.Engine`` it uses, declared here so
    that this module does not import the engine (which imports it to warm up)."""

    model: LoadedModel
    batched: BatchedTarget
    model_name: str
    vocab_size: int
    context_length: int
    max_num_seqs: int
    max_adaptive_depth: int
    available_drafters: tuple[str, ...]
    running: list[Sequence]

    def priced(self, costs: StepCosts) -> StepCosts: ...

    def add(self, request: GenerationRequest, tag: object = None) -> Sequence: ...

    def abort(self, sequence: Sequence) -> None: ...

    def step(self) -> list[tuple[Sequence, Any]]: ...


BATCH_SIZES = (1, 4, 8, 16)
DEPTHS = (1, 2, 4)
MODEL_DRAFTERS = ("mtp", "draft_model")

# Steps of a block after a depth switch that are not timed: the one that closes the queued
# work and the first forward of the new kind (nothing queued before it); a row drafting one
# step ahead (a model drafter's) one more, its first cycle feeding the head all the pairs
# its plain steps queued.
SETTLE_STEPS = 2
DRAFTING_SETTLE_STEPS = 3
TIMED_STEPS = 2  # per block of lookup rows
# A model drafter's cycles are timed longer and in more rounds: they are one row's (the
# cheapest steps), and the depth-1 cycle's price against a plain step is what decides
# whether chat drafts from the model at all.
DRAFTING_TIMED_STEPS = 6
DRAFTING_ROUNDS = 6
# The depths a model drafter's cycles are timed at in a round: depth 1 twice, the one whose
# price decides whether it drafts at all (chat: first-position acceptance ~0.3).
DRAFTING_DEPTHS = (1, 2, 1, 4)
# A sampled row's cycles (two kinds of sampled row would triple the drafters' share of the
# start-up): the model drafters' at the same depths in the lookup rows' rounds (3, not 6),
# lookup's at its shallowest and deepest timed depths (depths between on the line).
LOOKUP_SAMPLED_DEPTHS = (1, 4)

GREEDY = SamplerConfig(temperature=0.0)
# The samplers a sampled row's cycles are timed with, per kind (``mtplx.planner.
# sampling_kind``): the OpenAI default's (top-p 1, no top-k) at a chat temperature, and the
# same with the common top-p 0.95 (a sort of the whole vocabulary at every position; a top-k
# replaces it with partitions, measured to cost about as much). What a verdict and a plain
# draw cost does not depend on the temperature.
SAMPLERS = {
    SAMPLED: SamplerConfig(temperature=0.7, seed=0),
    FILTERED: SamplerConfig(temperature=0.7, top_p=0.95, seed=0),
}


class ScratchLookup(NgramDrafter):
    """Prompt lookup for calibration: drafts k one-hot tokens every cycle (the history's last
    k tokens when it has no n-gram match), so a lookup cycle of depth k is timed as one."""

    def match_length(self, history: list[int]) -> int:
        """Never 0: the planner asks a lookup with no match for nothing, and the scratch
        text soon stops repeating itself."""
        return max(super().match_length(history), self.min_ngram)

    def continuation(self, history: list[int], k: int) -> list[int]:
        """Lookup's proposals, padded from the end of the history to k tokens."""
        continuation = find_continuation(history, k, self.max_ngram, self.min_ngram)
        missing = k - len(continuation)
        padding = history[-missing:] if missing > 0 else []
        return continuation + padding


def _scratch_rows(
    engine: Engine, batch_size: int, drafter: str | None, sampler: SamplerConfig = GREEDY
) -> list[Sequence]:
    """``batch_size`` prefilled scratch rows (fixed depth 0, sampling with ``sampler``)
    drafting from ``drafter`` (None: scratch lookup)."""
    if engine.running:
        raise RuntimeError("calibration needs an idle engine")
    prompt = [(7 + i % 8) % engine.vocab_size for i in range(32)]
    request = GenerationRequest(
        prompt_ids=prompt,
        sampler=sampler,
        max_tokens=engine.context_length - len(prompt) - 1,
        ignore_eos=True,
        drafter=drafter or "ngram",
        depth=0,
    )
    rows = [engine.add(request) for _ in range(batch_size)]
    if drafter is None:
        for row in rows:
            row.drafter = ScratchLookup()
    while not all(row.prefilled for row in rows):
        engine.step()
    return rows


def _timed_steps(
    engine: Engine, rows: list[Sequence], depth: int, steps: int, settle: int = SETTLE_STEPS
) -> float:
    """Median seconds of ``steps`` steps with every row at ``depth``, after ``settle`` steps
    that switch the rows to it (closing queued forwards, or queuing them)."""
    for row in rows:
        row.depth = depth
    for _ in range(settle):
        engine.step()
    timings = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def _paired_ratios(
    engine: Engine,
    rows: list[Sequence],
    depths: tuple[int, ...],
    rounds: int,
    steps: int,
    settle: int = SETTLE_STEPS,
) -> tuple[float, dict[int, float]]:
    """(the median plain step's seconds, {depth: the median ratio of a step at that depth to
    a plain step}) of ``rows``: blocks of ``steps`` timed steps, every depth's block between
    two plain blocks (0, a, 0, b, 0, ... ; the depths' order rotating every round), each
    ratio over the mean of its two neighbours. A slow spell of a shared host (it slows every
    step alike, by up to 2x) then weighs on both sides of a ratio."""
    plain = [_timed_steps(engine, rows, 0, steps, settle) for _ in range(1 if depths else rounds)]
    ratios: dict[int, list[float]] = {k: [] for k in depths}  # a depth listed twice: 2 a round
    for r in range(rounds):
        shift = r % len(depths) if depths else 0
        for depth in depths[shift:] + depths[:shift]:
            seconds = _timed_steps(engine, rows, depth, steps, settle)
            plain.append(_timed_steps(engine, rows, 0, steps, settle))
            ratios[depth].append(seconds / ((plain[-2] + plain[-1]) / 2))
    return statistics.median(plain), {k: statistics.median(v) for k, v in ratios.items()}


def time_steps(engine: Engine, batch_size: int, depths: tuple[int, ...], rounds: int = 3):
    """{depth: median step seconds} of ``batch_size`` scratch lookup rows: the plain step's
    median, and each drafting depth's as that times its median ratio to the plain steps
    beside it (``_paired_ratios``)."""
    rows = _scratch_rows(engine, batch_size, None)
    try:
        drafting = tuple(k for k in depths if k > 0)
        plain, ratios = _paired_ratios(engine, rows, drafting, rounds, TIMED_STEPS)
        seconds = {k: plain * ratios[k] for k in drafting}
        return {0: plain, **seconds} if 0 in depths else seconds
    finally:
        for row in rows:
            engine.abort(row)


def time_drafting(
    engine: Engine,
    drafter: str | None,
    depths: tuple[int, ...],
    rounds: int = 3,
    sampler: SamplerConfig = GREEDY,
):
    """{depth: what one row drafting ``depth`` tokens from ``drafter`` (None: the scratch
    lookup) adds to its plain step, as a share of that step} (a depth listed twice is timed
    twice a round), as the engine runs the cycle (proposing, verifying, committing;
    one step ahead where the drafter pipelines): steady steps of one scratch row sampling
    with ``sampler`` at each depth against its plain steps beside them
    (``_paired_ratios``). A share, not seconds, so
    that the cost model's cycle is as much dearer than its plain step as the row's was,
    whatever the plain step it is priced on was timed at. Timing the proposing alone,
    synchronously, would also time what the engine overlaps with the step before."""
    rows = _scratch_rows(engine, 1, drafter, sampler)
    settle = SETTLE_STEPS if drafter is None else DRAFTING_SETTLE_STEPS
    try:
        _, ratios = _paired_ratios(engine, rows, depths, rounds, DRAFTING_TIMED_STEPS, settle)
        return {k: ratios[k] - 1.0 for k in depths}
    finally:
        for row in rows:
            engine.abort(row)


def _line(depths: tuple[int, ...], seconds: list[float]) -> tuple[float, float]:
    """(intercept, slope >= 0) of the least-squares line through (depth, seconds)."""
    if len(depths) < 2:
        return seconds[0], 0.0
    slope, intercept = statistics.linear_regression(depths, seconds)
    return intercept, max(slope, 0.0)


def drafting_costs(
    extra: dict[int, float], charged: Callable[[int], float], max_depth: int
) -> list[float]:
    """A model drafter's ``StepCosts.drafting`` line, depths 0..``max_depth``: each measured
    depth priced from its own timing (``extra[k]``: seconds a cycle of k drafts adds to a
    plain step), less ``charged(k)``, what the cost model already charges for verifying k
    drafts (more than the whole cycle adds where the engine verifies it one step ahead:
    then below 0); a depth between two measured ones on the line between them, one beyond
    the deepest measured on the last measured stretch. A cycle never adds less than a
    shallower one (nor less than nothing). One depth's timing moves no shallower depth's
    price (a line fitted through all depths let a noisy deep one misprice the shallow ones
    chat uses)."""
    measured = sorted(k for k in extra if k > 0)
    if not measured:
        return [0.0] * (max_depth + 1)
    points = [(0, 0.0)] + [(k, extra[k]) for k in measured]

    def seconds(depth: int) -> float:
        """The extra of a cycle of ``depth`` drafts: measured, or on the line between the
        measured depths around it (beyond the deepest, on the last stretch)."""
        i = next((i for i, (k, _) in enumerate(points) if k >= depth), len(points) - 1)
        (k0, s0), (k1, s1) = points[max(i - 1, 0)], points[max(i, 1)]
        return s0 + (s1 - s0) * (depth - k0) / (k1 - k0)

    line, cycle = [0.0], 0.0
    for depth in range(1, max_depth + 1):
        cycle = max(seconds(depth), cycle)
        line.append(cycle - charged(depth))
    return line


def calibrate(engine: Engine, rounds: int = 3) -> StepCosts:
    """Measure the step cost model of ``engine`` (see the module docstring)."""
    sizes = [b for b in BATCH_SIZES if b <= engine.max_num_seqs]
    plain, sync, per_token = [], [], []
    for batch_size in sizes:
        seconds = time_steps(engine, batch_size, (0, *DEPTHS), rounds)
        intercept, slope = _line(DEPTHS, [seconds[k] for k in DEPTHS])
        plain.append(seconds[0])
        sync.append(max(intercept - seconds[0], 0.0))
        per_token.append(slope)
    costs = StepCosts(sizes, plain, per_token, sync=sync)
    ahead = engine.priced(costs).ahead

    def line(name: str, shares: dict[int, float]) -> list[float]:
        """A drafting line from a row's measured shares: priced on this calibration's plain
        step, less what the cost model adds for verifying k drafts, so that a cycle's
        modelled cost (``StepCosts.drafting_time``) is the measured one."""
        synced = 0.0 if name in ahead else sync[0]

        def charged(k: int) -> float:
            return synced + k * per_token[0]

        extra = {k: share * plain[0] for k, share in shares.items()}
        return drafting_costs(extra, charged, engine.max_adaptive_depth)

    drafters = [name for name in MODEL_DRAFTERS if name in engine.available_drafters]
    for name in drafters:
        shares = time_drafting(engine, name, DRAFTING_DEPTHS, max(rounds, DRAFTING_ROUNDS))
        costs.drafting[name] = line(name, shares)
    for kind, sampler in SAMPLERS.items():
        lines = costs.sampled if kind == SAMPLED else costs.filtered
        for name in drafters:
            shares = time_drafting(engine, name, DRAFTING_DEPTHS, rounds, sampler)
            lines[name] = line(name, shares)
        shares = time_drafting(engine, None, LOOKUP_SAMPLED_DEPTHS, rounds, sampler)
        lines[LOOKUP] = line(LOOKUP, shares)
    return costs


def plain_step_seconds(engine: Engine, rounds: int = 3) -> float:
    """The median seconds of a plain step of one scratch row, timed as ``calibrate`` does."""
    return time_steps(engine, 1, (0,), rounds)[0]
