"""Timing an engine's steps for the start-up calibration: what is timed, and how the timings
become the step cost model."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplx import step_timing
from mtplx.drafters.base import DraftSampler
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.planner import FILTERED, GREEDY, SAMPLED, StepCosts, sampling_kind
from mtplx.request import SamplerConfig
from mtplx.step_timing import ScratchLookup, calibrate, time_steps
from tests.fixtures.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("step_timing")
    build_checkpoint("llama_mtp", directory)
    return Engine(load(directory), max_num_seqs=4, max_adaptive_depth=3)


def test_scratch_lookup_pads_its_proposals_from_the_history() -> None:
    sampler = DraftSampler(SamplerConfig(), 50, mx.zeros((3,)), None, None)
    tokens, qs = ScratchLookup().propose([1, 2, 3, 4, 5], 3, sampler)  # no n-gram repeats
    assert [int(t.item()) for t in tokens] == [3, 4, 5]
    assert [int(mx.argmax(q).item()) for q in qs] == [3, 4, 5]
    tokens, _ = ScratchLookup().propose([1, 2, 3, 1, 2], 3, sampler)  # lookup first: 3, 1, 2
    assert [int(t.item()) for t in tokens] == [3, 1, 2]
    # the planner drafts only where lookup reports a match: the scratch lookup always does
    assert ScratchLookup().match_length([1, 2, 3, 4, 5]) > 0


def test_timed_steps_draft_every_row_at_full_depth(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A scratch sequence soon stops repeating, and a lookup with no match drafts nothing: its
    # "drafting" steps were once timed as plain ones, which made lookup look free.
    per_step: list[list[int]] = []
    step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        before = {id(s): s.stats.num_draft_tokens for s in engine.running}
        events = step()
        per_step.append([s.stats.num_draft_tokens - before.get(id(s), 0) for s in engine.running])
        return events

    monkeypatch.setattr(engine, "step", recording_step)
    seconds = time_steps(engine, 3, (0, 2, 3), rounds=1)
    assert set(seconds) == {0, 2, 3} and all(s > 0 for s in seconds.values())
    assert not engine.running  # the scratch rows are gone
    drafted = {count for counts in per_step for count in counts}
    assert drafted == {0, 2, 3}  # every drafting step proposed its full depth, all rows
    assert all(len(set(counts)) == 1 for counts in per_step if counts)


def test_drafting_is_timed_as_the_engine_runs_the_cycles(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Proposing timed alone and synchronously once priced an MTP cycle at ~1.4x a plain step
    # where the engine's own cycles (one step ahead) cost ~1.2x: the adaptive policy then
    # kept to plain decoding where the head's drafts paid. Steps of a row drafting from the
    # model drafter, at each depth and at depth 0, are what is timed now.
    per_step: list[list[int]] = []
    pipelined: list[bool] = []
    step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        before = {id(s): s.stats.num_draft_tokens for s in engine.running}
        pipelined.append(any(engine.in_flight.drafts))
        events = step()
        per_step.append([s.stats.num_draft_tokens - before.get(id(s), 0) for s in engine.running])
        return events

    monkeypatch.setattr(engine, "step", recording_step)
    seconds = step_timing.time_drafting(engine, "mtp", (1, 3), rounds=1)
    assert set(seconds) == {1, 3}
    assert not engine.running  # the scratch row is gone
    assert {count for counts in per_step for count in counts} == {0, 1, 3}
    assert any(pipelined)  # the cycles ran one step ahead, as a request's do


def _priced_from_timings(
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    plain: float,
    per_token: float,
    shares: dict[int, float],
) -> StepCosts:
    """The engine's calibrated costs where a step at depth k times ``plain + k * per_token``
    seconds and every drafting row's cycles time ``shares`` (depth -> share of a plain step
    a cycle adds)."""
    monkeypatch.setattr(
        step_timing,
        "time_steps",
        lambda engine, batch_size, depths, rounds: {k: plain + k * per_token for k in depths},
    )
    monkeypatch.setattr(step_timing, "time_drafting", lambda e, name, depths, rounds, *s: shares)
    return engine.priced(calibrate(engine, rounds=1))


def test_a_model_drafters_cost_is_what_its_cycles_add_beyond_verifying(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, per_token = 0.010, 0.002
    extra = {1: 0.004, 2: 0.007, 4: 0.013}  # seconds a cycle adds to the plain step
    shares = {k: seconds / plain for k, seconds in extra.items()}
    costs = _priced_from_timings(engine, monkeypatch, plain, per_token, shares)
    assert "mtp" in costs.ahead  # so no step synchronisation is charged on top
    # depth 3, not measured, on the line between depths 2 and 4
    assert costs.drafting["mtp"] == pytest.approx([0.0, 0.002, 0.003, 0.004])
    # the modelled cycle is the measured one
    for k in (1, 2):
        modelled = costs.row_costs("mtp", 1, 3)[k]
        assert modelled == pytest.approx(plain + extra[k])


def test_a_cycle_is_priced_at_its_measured_share_of_the_calibrations_plain_step(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drafting row's own plain steps (timed beside its cycles) and the lookup rows' plain
    # step differ by what a shared host's load did between them: the cycle keeps its ratio.
    shares = {1: 0.2, 2: 0.45, 4: 1.1}
    costs = _priced_from_timings(engine, monkeypatch, 0.008, 0.001, shares)
    row = costs.row_costs("mtp", 1, 2)
    assert row[1] / row[0] == pytest.approx(1.2)
    assert row[2] / row[0] == pytest.approx(1.45)


def test_each_measured_depth_is_priced_from_its_own_timing() -> None:
    def charged(k: int) -> float:
        return 0.001 * k

    extra = {1: 0.003, 2: 0.0045, 4: 0.020}
    line = step_timing.drafting_costs(extra, charged, 5)
    # measured depths: their extra less the verifying charged; 3 between 2 and 4; 5 beyond 4
    # on the stretch from 2 to 4
    assert line == pytest.approx([0.0, 0.002, 0.0025, 0.00925, 0.016, 0.02275])
    assert charged(1) + line[1] == pytest.approx(extra[1])
    # a line fitted through depths 1, 2 and 4 prices depth 1 at 1.2 ms, not the 3 ms measured
    intercept, slope = step_timing._line((1, 2, 4), [extra[k] for k in (1, 2, 4)])
    assert intercept + slope == pytest.approx(0.0012, abs=1e-4)


def test_a_noisy_deep_depth_does_not_move_a_shallow_ones_price() -> None:
    def charged(k: int) -> float:
        return 0.0015 * k

    for deep in (0.004, 0.013, 0.05):  # depth 4 measured in a quiet spell, as expected, slow
        line = step_timing.drafting_costs({1: 0.0025, 2: 0.0045, 4: deep}, charged, 5)
        assert line[1] == pytest.approx(0.001) and line[2] == pytest.approx(0.0015)


def test_a_deeper_cycle_never_costs_less() -> None:
    def charged(k: int) -> float:
        return 0.001 * k

    # depth 2 measured below depth 1 (noise), depth 4 below the verifying it charges
    line = step_timing.drafting_costs({1: 0.004, 2: 0.0035, 4: 0.002}, charged, 5)
    assert line[0] == 0.0 and line[1] == pytest.approx(0.003)  # depth 1 its own timing
    costs = StepCosts([1], [0.01], [0.001], drafting={"mtp": line}, ahead=("mtp",))
    row = costs.row_costs("mtp", 1, 5)
    assert row == pytest.approx([0.01] + [0.014] * 5)  # no deeper cycle below depth 1's
    assert step_timing.drafting_costs({}, charged, 3) == [0.0] * 4


def test_a_depth_listed_twice_is_timed_twice_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks: list[int] = []

    def scripted(engine: object, rows: object, depth: int, steps: int, settle: int) -> float:
        blocks.append(depth)
        return 0.01 * (1 + 0.2 * depth)

    monkeypatch.setattr(step_timing, "_timed_steps", scripted)
    depths = step_timing.DRAFTING_DEPTHS
    _, ratios = step_timing._paired_ratios(None, [], depths, rounds=2, steps=6)  # type: ignore[arg-type]
    assert sorted(ratios) == [1, 2, 4] and ratios[1] == pytest.approx(1.2)
    assert blocks.count(1) == 4 and blocks.count(2) == blocks.count(4) == 2


def test_a_cycle_run_ahead_may_cost_less_than_a_lookup_verified_token() -> None:
    # Verifying one step ahead overlaps building the next step: at batch 1 the MTP cycle's
    # whole extra (0.9 ms on a 6.2 ms plain step, measured) was below the 1.75 ms one more
    # lookup-verified token adds. Its price is what it measured, not the lookup's token.
    def charged(k: int) -> float:
        return 0.002 * k

    line = step_timing.drafting_costs({1: 0.001, 2: 0.003, 4: 0.008}, charged, 4)
    assert line[1] == pytest.approx(-0.001)
    costs = StepCosts([1, 4], [0.01, 0.02], [0.002, 0.004], drafting={"mtp": line}, ahead=("mtp",))
    assert costs.row_costs("mtp", 1, 4) == pytest.approx([0.01, 0.011, 0.013, 0.0155, 0.018])
    for batch_size in (1, 2, 4, 8):
        times = [costs.drafting_time("mtp", batch_size, k) for k in range(5)]
        assert times[0] == 0.0 and all(t >= 0.0 for t in times) and times == sorted(times)


def test_paired_ratios_weigh_a_slow_spell_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    # Timed blocks as a shared host gives them: a depth-k step costs 1 + 0.2 k plain steps,
    # but every step is 2x slower in a busy spell that starts in the middle of the run. Plain
    # medians over a round (and their differences) then mix quiet and busy blocks; a ratio
    # to the plain blocks beside it does not.
    blocks: list[int] = []

    def scripted(engine: object, rows: object, depth: int, steps: int, settle: int) -> float:
        blocks.append(depth)
        slow = 2.0 if len(blocks) > 9 else 1.0
        return 0.01 * slow * (1 + 0.2 * depth)

    monkeypatch.setattr(step_timing, "_timed_steps", scripted)
    plain, ratios = step_timing._paired_ratios(None, [], (1, 2, 4), rounds=3, steps=4)  # type: ignore[arg-type]
    assert blocks[::2] == [0] * 10  # every depth's block between two plain ones
    assert sorted(blocks[1::2]) == [1, 1, 1, 2, 2, 2, 4, 4, 4]  # rotated every round
    assert blocks[1:6:2] != blocks[7:12:2]
    for k in (1, 2, 4):
        assert ratios[k] == pytest.approx(1 + 0.2 * k, rel=0.1)
    assert 0.01 <= plain <= 0.02


def test_calibration_measures_every_batch_size_and_model_drafter(engine: Engine) -> None:
    costs = calibrate(engine, rounds=1)
    assert costs.batch_sizes == [1, 4]
    assert all(c > 0 for c in costs.plain) and all(c >= 0 for c in costs.per_token)
    assert set(costs.drafting) == {"mtp"}
    drafting = costs.drafting["mtp"]
    assert len(drafting) == engine.max_adaptive_depth + 1 and drafting[0] == 0.0
    row = engine.priced(costs).row_costs("mtp", 1, engine.max_adaptive_depth)
    assert row == sorted(row)  # a deeper cycle never costs less
    # a sampled row's cycles: the model drafter's and lookup's
    for kind, lines in ((SAMPLED, costs.sampled), (FILTERED, costs.filtered)):
        assert set(lines) == {"mtp", "ngram"}
        for source, line in lines.items():
            assert len(line) == engine.max_adaptive_depth + 1 and line[0] == 0.0
            row = engine.priced(costs).row_costs(source, 1, engine.max_adaptive_depth, kind)
            assert row == sorted(row)


def test_sampled_cycles_are_timed_on_a_row_that_samples(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A greedy row's verdict is an argmax, a sampled row's the target's distribution at
    # every position: timing a greedy row priced sampled cycles ~1.2x a plain step where
    # they cost ~1.7x. The rows timed for a sampled line sample so, and draft at each depth.
    seen: list[tuple[str, int]] = []
    step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        before = {id(s): s.stats.num_draft_tokens for s in engine.running}
        events = step()
        for s in engine.running:
            drafted = s.stats.num_draft_tokens - before.get(id(s), 0)
            seen.append((sampling_kind(s.config), drafted))
        return events

    monkeypatch.setattr(engine, "step", recording_step)
    for kind, sampler in step_timing.SAMPLERS.items():
        assert sampling_kind(sampler) == kind
        for drafter in ("mtp", None):  # the model drafter, then the scratch lookup
            seen.clear()
            shares = step_timing.time_drafting(engine, drafter, (1, 2), 1, sampler)
            assert set(shares) == {1, 2} and not engine.running
            assert {k for k, _ in seen} == {kind} and {d for _, d in seen} == {0, 1, 2}


def _scripted_timing(
    monkeypatch: pytest.MonkeyPatch, shares: dict[str, dict[str, dict[int, float]]]
) -> list[tuple[str | None, str]]:
    """Time steps as a plain 10 ms + 2 ms a lookup token, and drafting rows' shares as
    scripted: ``shares[kind][source]`` for a row that samples as ``kind``. Returns the
    (drafter, kind) of every drafting timing asked for."""
    asked: list[tuple[str | None, str]] = []
    monkeypatch.setattr(
        step_timing,
        "time_steps",
        lambda engine, batch_size, depths, rounds: {k: 0.010 + k * 0.002 for k in depths},
    )

    def time_drafting(  # type: ignore[no-untyped-def]
        engine, name, depths, rounds, sampler=step_timing.GREEDY
    ):
        kind = sampling_kind(sampler)
        asked.append((name, kind))
        return shares[kind]["ngram" if name is None else name]

    monkeypatch.setattr(step_timing, "time_drafting", time_drafting)
    return asked


def test_a_sampled_row_is_priced_at_its_sampled_cycles_share(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Measured: a sampled depth-1 MTP cycle ~1.7 sampled plain steps, a greedy one ~1.2
    # greedy plain steps. Each kind of row is priced at its own ratio.
    shares = {
        GREEDY: {"mtp": {1: 0.2, 2: 0.5, 4: 1.1}},
        SAMPLED: {"mtp": {1: 0.7, 2: 1.1, 4: 2.0}, "ngram": {1: 0.5, 4: 1.4}},
        FILTERED: {"mtp": {1: 0.9, 2: 1.5, 4: 2.6}, "ngram": {1: 0.6, 4: 2.0}},
    }
    asked = _scripted_timing(monkeypatch, shares)
    costs = engine.priced(calibrate(engine, rounds=1))
    assert asked == [
        ("mtp", GREEDY),
        ("mtp", SAMPLED),
        (None, SAMPLED),
        ("mtp", FILTERED),
        (None, FILTERED),
    ]
    for kind, by_source in shares.items():
        for source, measured in by_source.items():
            row = costs.row_costs(source, 1, engine.max_adaptive_depth, kind)
            for k in (k for k in measured if k <= engine.max_adaptive_depth):
                assert row[k] / row[0] == pytest.approx(1 + measured[k])
    # a greedy lookup row keeps the lookup rows' line: sync + k verified tokens
    assert costs.row_costs("ngram", 1, 1) == pytest.approx([0.010, 0.012])


def test_a_sampled_line_measured_cheaper_than_a_greedy_one_is_kept() -> None:
    # Each line is its own measurement (a noisy one may come out below the other): the
    # sampled price is what the sampled row measured, not floored at the greedy one.
    def charged(k: int) -> float:
        return 0.001 * k

    greedy = step_timing.drafting_costs({1: 0.003, 2: 0.005}, charged, 2)
    sampled = step_timing.drafting_costs({1: 0.0025, 2: 0.006}, charged, 2)
    costs = StepCosts([1], [0.01], [0.001], drafting={"mtp": greedy}, sampled={"mtp": sampled})
    assert costs.row_costs("mtp", 1, 2) == pytest.approx([0.01, 0.013, 0.015])
    assert costs.row_costs("mtp", 1, 2, SAMPLED) == pytest.approx([0.01, 0.0125, 0.016])
