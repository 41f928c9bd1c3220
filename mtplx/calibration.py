"""The step cost model of an engine (``mtplx.planner.StepCosts``), measured at start-up
(``mtplx.step_timing``: how the steps are timed) and cached.

The result is cached per model, machine and code version under ``$MTPLX_HOME/calibration``
(``$MTPLX_CALIBRATION_DIR`` where set: ``mtplx.build_dirs.calibration_dir``), so a restart
loads it instead of measuring again. A calibration is only as good as the quiet it was
measured in, so two guards keep a bad one from living on: one measured while other processes
kept a large share of the CPUs busy serves its own run but is not cached, and a cached one is
checked at load against a fresh timing of the plain step (a few steps, ~1 s) and measured
again when a quiet machine no longer matches it (another BLAS, CPU frequency or host).

A cache file is trusted only when it names this code's ``CALIBRATION_VERSION``, this model
and this key, and holds a cost model of this engine's shape (its batch sizes and drafters,
finite seconds, non-negative but for a drafter's own); any other (another version's, a
truncated or hand-edited one) is ignored with a warning and measured again. It is written
whole or not at all (a private temporary file renamed into place), so a process stopped
while it calibrates or writes leaves nothing a later start reads. Where the cache cannot be
written (``MTPLX_HOME`` read only) the costs are measured once, for this run, with one
warning before the measuring.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path

from mtplx import host_load
from mtplx.build_dirs import calibration_dir
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.planner import StepCosts
from mtplx.step_timing import (
    BATCH_SIZES,
    MODEL_DRAFTERS,
    Engine,
    calibrate,
    plain_step_seconds,
)

logger = logging.getLogger(__name__)


CALIBRATION_VERSION = 5  # bump when what is measured changes
# Other processes' share of the CPUs above which a calibration is not cached: on a shared
# 2-core host a second process calibrating at the same time doubled every step.
MAX_BACKGROUND_LOAD = 0.25
# A cached calibration is measured again when the plain step timed at load differs from its
# own by more than this factor (either way); one calibration's batch-1 plain step scatters
# by ~10% on a quiet machine, one taken under load by 2x.
MAX_DRIFT = 1.3


def _cache_path(engine: Engine) -> Path:
    """Where ``engine``'s calibration is cached: keyed by the checkpoint (path, size and
    time of its files), the machine, the BLAS and the engine's shape (the file's name ends
    with the key, ``_cache_key``)."""
    return calibration_dir() / f"{engine.model_name}-{_cache_key(engine)}.json"


def _cache_key(engine: Engine) -> str:
    """The digest of everything a calibration of ``engine`` depends on."""
    from mtplx.blas import blas_info

    path = Path(engine.model.path)
    files = sorted(path.glob("*")) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    blas = blas_info()
    key = json.dumps(
        [
            CALIBRATION_VERSION,
            str(path.resolve()),
            stats,
            platform.machine(),
            platform.processor() or _cpu_model(),
            os.cpu_count(),
            blas.name,
            blas.threads,
            engine.max_num_seqs,
            engine.max_adaptive_depth,
            engine.available_drafters,
            # A pipeline's forwards cost what its ranks and links do (absent otherwise, so
            # single-process keys are unchanged).
            *filter(None, [engine.batched.calibration_key]),
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# The fields of a cached cost model (``StepCosts.to_dict``: what was measured).
_MEASURED_FIELDS = sorted(StepCosts([1], [1.0], [0.0]).to_dict())


class UnusableCache(ValueError):
    """A cache file that is not a calibration of this engine by this code (the reason)."""


def _read_cache(engine: Engine, path: Path) -> StepCosts | None:
    """The calibration cached at ``path`` when it is one of ``engine`` by this code; None
    when there is none, or (with a warning) when the file is not to be trusted."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # none cached (or no directory for one)
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("cannot read the cached calibration %s (%s): measuring again", path, exc)
        return None
    try:
        return parse_cache(text, engine)
    except UnusableCache as exc:
        logger.warning("ignoring the cached calibration %s: %s; measuring again", path, exc)
        return None


def cache_document(engine: Engine, costs: StepCosts) -> dict[str, object]:
    """The JSON document a calibration of ``engine`` is cached as: the costs, stamped with
    the code's version, the model and the cache key."""
    return {
        "version": CALIBRATION_VERSION,
        "model": engine.model_name,
        "key": _cache_key(engine),
        "costs": costs.to_dict(),
    }


def parse_cache(text: str, engine: Engine) -> StepCosts:
    """The step costs of a cache file's ``text``; raises ``UnusableCache`` (saying why)
    unless it is a ``cache_document`` of ``engine`` by this code whose costs have this
    engine's shape: its batch sizes, a drafting line for each of its model drafters up to
    its depth, a sampled row's lines (without and with a filter) for each of them and for
    lookup, and finite seconds (positive plain steps, non-negative other than a drafting
    line's)."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise UnusableCache(f"not valid JSON (truncated or corrupt: {exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("costs"), dict):
        raise UnusableCache(
            "not a calibration (no version stamp: an older MTPLX's, or another file)"
        )
    version = document.get("version")
    if version != CALIBRATION_VERSION:
        raise UnusableCache(
            f"calibration version {version!r}, this MTPLX's is {CALIBRATION_VERSION}"
        )
    if document.get("model") != engine.model_name or document.get("key") != _cache_key(engine):
        raise UnusableCache(
            f"measured for another model, machine or engine shape ({document.get('model')!r})"
        )
    costs = document["costs"]
    if sorted(costs) != _MEASURED_FIELDS:
        raise UnusableCache(f"fields {sorted(costs)}, not {_MEASURED_FIELDS}")
    sizes = [b for b in BATCH_SIZES if b <= engine.max_num_seqs]
    if costs.get("batch_sizes") != sizes:
        raise UnusableCache(f"batch sizes {costs.get('batch_sizes')!r}, not {sizes}")
    for name in ("plain", "per_token", "sync"):
        _check_seconds(name, costs.get(name), len(sizes), positive=name == "plain")
    drafters = sorted(n for n in MODEL_DRAFTERS if n in engine.available_drafters)
    drafting = costs.get("drafting")
    if not isinstance(drafting, dict) or sorted(drafting) != drafters:
        raise UnusableCache(f"drafting costs for {drafting!r}, not {drafters}")
    for name, line in drafting.items():
        # below 0 where a drafter's cycles verify cheaper than lookup's (``StepCosts``)
        _check_seconds(f"drafting[{name!r}]", line, engine.max_adaptive_depth + 1, signed=True)
    sources = sorted([*drafters, LOOKUP])
    for kind in ("sampled", "filtered"):
        lines = costs.get(kind)
        if not isinstance(lines, dict) or sorted(lines) != sources:
            raise UnusableCache(f"{kind} costs for {lines!r}, not {sources}")
        for name, line in lines.items():
            _check_seconds(f"{kind}[{name!r}]", line, engine.max_adaptive_depth + 1, signed=True)
    return StepCosts(**costs)


def _check_seconds(
    name: str, values: object, length: int, positive: bool = False, signed: bool = False
) -> None:
    """Raise ``UnusableCache`` unless ``values`` is a list of ``length`` finite seconds >= 0
    (> 0 where ``positive``; any sign where ``signed``)."""
    ok = (
        isinstance(values, list)
        and len(values) == length
        and all(
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and (v > 0 if positive else signed or v >= 0)
            for v in values
        )
    )
    if not ok:
        raise UnusableCache(f"{name} is {values!r}: not {length} finite seconds")


def _still_fits(engine: Engine, cached: StepCosts, path: Path) -> bool:
    """Whether ``cached`` still describes the machine: its plain step is within
    ``MAX_DRIFT`` of one timed now, or the timing was taken under load (a busy spell slows
    every step alike, so the quiet machine's costs still price depths against each other,
    and measuring again would take minutes of the busy machine and not be cached)."""
    cpu_before = host_load.snapshot()
    measured = plain_step_seconds(engine)
    load = host_load.background_load(cpu_before, host_load.snapshot())
    drift = measured / cached.plain[0] if cached.plain and cached.plain[0] > 0 else math.inf
    if 1 / MAX_DRIFT <= drift <= MAX_DRIFT:
        return True
    cached_ms = cached.plain[0] * 1e3 if cached.plain else math.nan
    if load is not None and load > MAX_BACKGROUND_LOAD:
        logger.warning(
            "a plain step takes %.1f ms now, %.1f ms in the cached calibration, while other "
            "processes keep %.0f%% of the CPUs busy: keeping the cached one",
            measured * 1e3,
            cached_ms,
            load * 100,
        )
        return True
    logger.warning(
        "a plain step takes %.1f ms now, the cached calibration %s says %.1f ms: measuring again",
        measured * 1e3,
        path,
        cached_ms,
    )
    return False


def load_or_calibrate(engine: Engine) -> StepCosts:
    """The cached calibration of ``engine`` while the machine still matches it, or a new one
    (then cached, unless other processes loaded the machine while it was measured or the
    cache cannot be written)."""
    path = _cache_path(engine)
    cached = _read_cache(engine, path)
    if cached is not None and _still_fits(engine, cached, path):
        logger.info("step costs loaded from %s", path)
        return cached
    unwritable = _cannot_write(path.parent)
    if unwritable:
        logger.warning(
            "the calibration cannot be cached in %s (%s): the step costs measured now serve "
            "this run only, and every start measures them again (make the directory writable "
            "to keep them)",
            path.parent,
            unwritable,
        )
    logger.info("measuring the step costs of this machine for %s", engine.model_name)
    started, cpu_before = time.perf_counter(), host_load.snapshot()
    costs = calibrate(engine)
    load = host_load.background_load(cpu_before, host_load.snapshot())
    logger.info(
        "step costs measured in %.1f s: plain %s ms, per token %s ms, drafting %s, "
        "sampled %s, filtered %s",
        time.perf_counter() - started,
        [round(c * 1e3, 1) for c in costs.plain],
        [round(c * 1e3, 1) for c in costs.per_token],
        {k: [round(c * 1e3, 1) for c in v] for k, v in costs.drafting.items()},
        {k: [round(c * 1e3, 1) for c in v] for k, v in costs.sampled.items()},
        {k: [round(c * 1e3, 1) for c in v] for k, v in costs.filtered.items()},
    )
    if load is not None and load > MAX_BACKGROUND_LOAD:
        logger.warning(
            "other processes kept %.0f%% of the CPUs busy while the step costs were measured: "
            "they serve this run but are not cached",
            load * 100,
        )
        return costs
    if not unwritable:
        _write_cache(path, cache_document(engine, costs))
    return costs


def _cannot_write(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (created first where missing); None
    when one can. Asked before measuring, so that the warning comes before the minutes."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _write_cache(path: Path, document: dict[str, object]) -> None:
    """Write ``document`` to ``path`` whole or not at all: into a private temporary file in
    its directory (a concurrent writer has its own), flushed to disk, then renamed over
    ``path``. One attempt; a failure is a warning."""
    tmp = None
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            json.dump(document, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the calibration at %s: %s", path, exc)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
