"""Start-up calibration of the step cost model: its cache (the timing itself:
``tests/test_step_timing.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mtplx import calibration
from mtplx.calibration import load_or_calibrate
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.planner import StepCosts
from tests.fixtures.checkpoints import build_checkpoint


@pytest.fixture(autouse=True)
def cache_under_the_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests name an ``MTPLX_HOME`` and look for the cache in its ``calibration``: the
    session's own calibration directory (``tests/conftest.py``) is not set for them."""
    monkeypatch.delenv("MTPLX_CALIBRATION_DIR", raising=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("calibration")
    build_checkpoint("llama_mtp", directory)
    return Engine(load(directory), max_num_seqs=4, max_adaptive_depth=3)


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
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    first = load_or_calibrate(engine)
    monkeypatch.setattr(calibration, "plain_step_seconds", lambda engine: first.plain[0])
    second = load_or_calibrate(engine)
    assert measured == [1] and second == first
    assert list((tmp_path / "calibration").glob("*.json"))


def _counting_calibrate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    measured: list[int] = []
    real = calibration.calibrate

    def counting(engine: Engine, rounds: int = 3):  # type: ignore[no-untyped-def]
        measured.append(1)
        return real(engine, rounds=1)

    monkeypatch.setattr(calibration, "calibrate", counting)
    return measured


def test_a_calibration_directory_apart_from_the_home_holds_the_cache(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MTPLX_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    measured = _counting_calibrate(monkeypatch)
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    first = load_or_calibrate(engine)
    monkeypatch.setattr(calibration, "plain_step_seconds", lambda engine: first.plain[0])
    assert load_or_calibrate(engine) == first and measured == [1]  # read back from there
    assert len(list((tmp_path / "calibrations").glob("*.json"))) == 1
    assert not (tmp_path / "home" / "calibration").exists()


def test_a_calibration_under_load_serves_its_run_but_is_not_cached(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    measured = _counting_calibrate(monkeypatch)
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.6)
    costs = load_or_calibrate(engine)
    assert measured == [1] and costs.plain
    assert not list(tmp_path.glob("calibration/*.json"))
    load_or_calibrate(engine)  # nothing cached: measured again
    assert measured == [1, 1]
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.1)
    load_or_calibrate(engine)
    assert list(tmp_path.glob("calibration/*.json"))


def test_a_cached_calibration_the_machine_no_longer_matches_is_measured_again(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    measured = _counting_calibrate(monkeypatch)
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    first = load_or_calibrate(engine)
    (path,) = tmp_path.glob("calibration/*.json")
    # a plain step as slow as under load: the cache no longer fits the machine
    stale = StepCosts(**{**first.to_dict(), "plain": [c * 100 for c in first.plain]})
    path.write_text(json.dumps(calibration.cache_document(engine, stale)))
    fresh = load_or_calibrate(engine)
    assert measured == [1, 1] and fresh.plain[0] < stale.plain[0] / 10
    assert json.loads(path.read_text())["costs"]["plain"] == fresh.plain  # the new one is cached
    # within the drift a cached calibration is kept, however the check's timing falls
    for factor in (1 / calibration.MAX_DRIFT * 1.01, 1.0, calibration.MAX_DRIFT * 0.99):
        monkeypatch.setattr(
            calibration, "plain_step_seconds", lambda engine, factor=factor: fresh.plain[0] * factor
        )
        assert load_or_calibrate(engine) == fresh
    assert measured == [1, 1]
    monkeypatch.setattr(
        calibration,
        "plain_step_seconds",
        lambda engine: fresh.plain[0] * calibration.MAX_DRIFT * 1.01,
    )
    load_or_calibrate(engine)
    assert measured == [1, 1, 1]


def test_the_drift_check_times_a_plain_step(engine: Engine) -> None:
    seconds = calibration.plain_step_seconds(engine, rounds=1)
    assert seconds > 0 and not engine.running


def test_a_drift_seen_under_load_keeps_the_cached_calibration(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    measured = _counting_calibrate(monkeypatch)
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    first = load_or_calibrate(engine)
    slow = first.plain[0] * calibration.MAX_DRIFT * 2
    monkeypatch.setattr(calibration, "plain_step_seconds", lambda engine: slow)
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.5)
    assert load_or_calibrate(engine) == first  # a busy spell, not another machine
    assert measured == [1]


def _corrupt(document: dict) -> dict[str, str]:
    """Cache files a start must not trust, by what is wrong with them."""
    costs = document["costs"]

    def edited(**fields: object) -> str:
        return json.dumps({**document, **fields})

    def edited_costs(**fields: object) -> str:
        return edited(costs={**costs, **fields})

    text = json.dumps(document)
    return {
        "another_version": edited(version=calibration.CALIBRATION_VERSION - 1),
        "no_version_stamp": json.dumps(costs),  # the format before the stamp
        "truncated": text[: len(text) // 2],
        "empty": "",
        "not_json": "\x00\x01 garbage",
        "a_list": json.dumps([costs]),
        "another_model": edited(model="another-model"),
        "another_key": edited(key="0" * 16),
        "other_batch_sizes": edited_costs(batch_sizes=[1, 2]),
        "a_plain_step_of_zero": edited_costs(plain=[0.0] * len(costs["plain"])),
        "negative_seconds": edited_costs(per_token=[-1.0] * len(costs["per_token"])),
        "not_a_number": text.replace(str(costs["plain"][0]), "NaN", 1),
        "an_infinite_drafting_cost": edited_costs(
            drafting={k: [0.0] + [-math.inf] * (len(v) - 1) for k, v in costs["drafting"].items()}
        ),
        "strings": edited_costs(sync=["0.1"] * len(costs["sync"])),
        "booleans": edited_costs(sync=[True] * len(costs["sync"])),
        "too_few_values": edited_costs(plain=costs["plain"][:-1]),
        "a_missing_drafter": edited_costs(drafting={}),
        "a_short_drafting_line": edited_costs(drafting={"mtp": [0.0, 0.001]}),
        "no_sampled_lines": edited_costs(sampled={}),
        "a_missing_filtered_lookup_line": edited_costs(
            filtered={k: v for k, v in costs["filtered"].items() if k != "ngram"}
        ),
        "a_short_sampled_line": edited_costs(sampled={**costs["sampled"], "mtp": [0.0, 0.001]}),
        "an_infinite_filtered_cost": edited_costs(
            filtered={k: [0.0, math.inf, *v[2:]] for k, v in costs["filtered"].items()}
        ),
        "an_unknown_field": edited_costs(seconds=[0.1]),
        "a_field_not_measured": edited_costs(ahead=["mtp"]),
    }


_CORRUPT_CASES = [
    "another_version",
    "no_version_stamp",
    "truncated",
    "empty",
    "not_json",
    "a_list",
    "another_model",
    "another_key",
    "other_batch_sizes",
    "a_plain_step_of_zero",
    "negative_seconds",
    "not_a_number",
    "an_infinite_drafting_cost",
    "strings",
    "booleans",
    "too_few_values",
    "a_missing_drafter",
    "a_short_drafting_line",
    "no_sampled_lines",
    "a_missing_filtered_lookup_line",
    "a_short_sampled_line",
    "an_infinite_filtered_cost",
    "an_unknown_field",
    "a_field_not_measured",
]


@pytest.mark.parametrize("case", _CORRUPT_CASES)
def test_a_cache_file_not_written_for_this_engine_is_ignored_and_measured_again(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    measured = _counting_calibrate(monkeypatch)
    first = load_or_calibrate(engine)
    (path,) = tmp_path.glob("calibration/*.json")
    good = json.loads(path.read_text())
    assert calibration.parse_cache(path.read_text(), engine) == first
    monkeypatch.setattr(calibration, "plain_step_seconds", lambda engine: first.plain[0])
    path.write_text(_corrupt(good)[case])
    with caplog.at_level("WARNING", logger="mtplx.calibration"):
        again = load_or_calibrate(engine)
    assert measured == [1, 1]  # not trusted: measured again, no exception
    assert f"ignoring the cached calibration {path}" in caplog.text
    assert json.loads(path.read_text()) == calibration.cache_document(engine, again)


def test_a_cached_drafting_line_below_zero_is_trusted(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cycle run ahead can add less than the lookup-verified tokens the model charges for
    # it (``drafting_costs``): its own line is then below 0, and that is a measurement.
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    measured = _counting_calibrate(monkeypatch)
    first = load_or_calibrate(engine)
    (path,) = tmp_path.glob("calibration/*.json")
    depths = engine.max_adaptive_depth
    below = {"mtp": [0.0] + [-0.0005 * k for k in range(1, depths + 1)]}
    cached = StepCosts(**{**first.to_dict(), "drafting": below})
    path.write_text(json.dumps(calibration.cache_document(engine, cached)))
    monkeypatch.setattr(calibration, "plain_step_seconds", lambda engine: first.plain[0])
    assert load_or_calibrate(engine) == cached
    assert measured == [1]


def test_the_cache_file_is_written_whole_or_not_at_all(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    measured = _counting_calibrate(monkeypatch)
    fsync, failed = calibration.os.fsync, []

    def full_disk_once(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise OSError(28, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(calibration.os, "fsync", full_disk_once)
    load_or_calibrate(engine)  # the write fails after the document went into the file
    assert failed and list((tmp_path / "calibration").iterdir()) == []  # no half file left
    costs = load_or_calibrate(engine)  # nothing cached: measured again, and cached
    (path,) = (tmp_path / "calibration").iterdir()  # the document alone: no temporary left
    assert measured == [1, 1] and calibration.parse_cache(path.read_text(), engine) == costs


def test_an_unwritable_home_measures_once_for_the_run_with_one_warning(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MTPLX_HOME", str(blocker / "home"))  # below a file: cannot be made
    monkeypatch.setattr(calibration.host_load, "background_load", lambda start, end: 0.0)
    measured = _counting_calibrate(monkeypatch)
    written: list[Path] = []
    monkeypatch.setattr(calibration, "_write_cache", lambda path, document: written.append(path))
    with caplog.at_level("INFO", logger="mtplx.calibration"):
        costs = load_or_calibrate(engine)
    assert measured == [1] and costs.plain and not written  # no write tried
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "serve this run only" in warnings[0].getMessage()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.index(warnings[0].getMessage()) < next(  # said before the measuring
        i for i, m in enumerate(messages) if m.startswith("measuring the step costs")
    )
