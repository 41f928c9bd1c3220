"""Start-up calibration of the step cost model: what it times, and its cache."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mtplx import calibration
from mtplx.calibration import ScratchLookup, calibrate, load_or_calibrate, time_steps
from mtplx.drafters.base import DraftSampler
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.sampling import SamplerConfig
from tests.fixtures.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("calibration")
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


def test_drafting_is_timed_per_depth(engine: Engine) -> None:
    seconds = calibration.time_drafting(engine, "mtp", (1, 3), rounds=1)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())
    assert not engine.running and not engine.time_drafts  # requests draft asynchronously


def test_calibration_measures_every_batch_size_and_model_drafter(engine: Engine) -> None:
    costs = calibrate(engine, rounds=1)
    assert costs.batch_sizes == [1, 4]
    assert all(c > 0 for c in costs.plain) and all(c >= 0 for c in costs.per_token)
    assert set(costs.drafting) == {"mtp"}
    drafting = costs.drafting["mtp"]
    assert len(drafting) == engine.max_adaptive_depth + 1 and drafting[0] == 0.0
    assert drafting == sorted(drafting)  # a line of slope >= 0


def test_calibration_is_cached_per_model_and_machine(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    measured = []
    real = calibration.calibrate

    def counting(engine: Engine, rounds: int = 3):  # type: ignore[no-untyped-def]
        measured.append(1)
        return real(engine, rounds=1)

    monkeypatch.setattr(calibration, "calibrate", counting)
    first = load_or_calibrate(engine)
    second = load_or_calibrate(engine)
    assert measured == [1] and second == first
    assert list((tmp_path / "calibration").glob("*.json"))
