"""The step cost model of an engine (``mtplx.planner.StepCosts``), measured at start-up.

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

The result is cached per model, machine and code version under ``$MTPLX_HOME/calibration``,
so a restart loads it instead of measuring again. A calibration is only as good as the quiet
it was measured in, so two guards keep a bad one from living on: one measured while other
processes kept a large share of the CPUs busy serves its own run but is not cached, and a
cached one is checked at load against a fresh timing of the plain step (a few steps, ~1 s)
and measured again when a quiet machine no longer matches it (another BLAS, CPU frequency or
host).

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
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mtplx import host_load
from mtplx.build_dirs import mtplx_home
from mtplx.drafters.ngram import NgramDrafter, find_continuation
from mtplx.planner import StepCosts
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig

if TYPE_CHECKING:
    from mtplx.models.base import LoadedModel
    from mtplx.models.rows import BatchedTarget
    from mtplx.sequence import Sequence

logger = logging.getLogger(__name__)


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


CALIBRATION_VERSION = 4  # bump when what is measured changes
BATCH_SIZES = (1, 4, 8, 16)
DEPTHS = (1, 2, 4)
MODEL_DRAFTERS = ("mtp", "draft_model")
# Other processes' share of the CPUs above which a calibration is not cached: on a shared
# 2-core host a second process calibrating at the same time doubled every step.
MAX_BACKGROUND_LOAD = 0.25
# A cached calibration is measured again when the plain step timed at load differs from its
# own by more than this factor (either way); one calibration's batch-1 plain step scatters
# by ~10% on a quiet machine, one taken under load by 2x.
MAX_DRIFT = 1.3
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


def _scratch_rows(engine: Engine, batch_size: int, drafter: str | None) -> list[Sequence]:
    """``batch_size`` prefilled scratch rows (greedy, fixed depth 0) drafting from
    ``drafter`` (None: scratch lookup)."""
    if engine.running:
        raise RuntimeError("calibration needs an idle engine")
    prompt = [(7 + i % 8) % engine.vocab_size for i in range(32)]
    request = GenerationRequest(
        prompt_ids=prompt,
        sampler=SamplerConfig(temperature=0.0),
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


def time_drafting(engine: Engine, drafter: str, depths: tuple[int, ...], rounds: int = 3):
    """{depth: what one row drafting ``depth`` tokens from ``drafter`` adds to its plain step,
    as a share of that step} (a depth listed twice is timed twice a round), as the engine
    runs the cycle (proposing, verifying, committing;
    one step ahead where the drafter pipelines): steady steps of one scratch row at each
    depth against its plain steps beside them (``_paired_ratios``). A share, not seconds, so
    that the cost model's cycle is as much dearer than its plain step as the row's was,
    whatever the plain step it is priced on was timed at. Timing the proposing alone,
    synchronously, would also time what the engine overlaps with the step before."""
    rows = _scratch_rows(engine, 1, drafter)
    try:
        _, ratios = _paired_ratios(
            engine, rows, depths, rounds, DRAFTING_TIMED_STEPS, DRAFTING_SETTLE_STEPS
        )
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
    for name in MODEL_DRAFTERS:
        if name not in engine.available_drafters:
            continue
        shares = time_drafting(engine, name, DRAFTING_DEPTHS, max(rounds, DRAFTING_ROUNDS))
        # The cycles' shares of a plain step priced on this calibration's plain step; what
        # the cost model adds for verifying k drafts comes off, so that a cycle's modelled
        # cost (``StepCosts.drafting_time``) is the measured one.
        synced = 0.0 if name in ahead else sync[0]

        def charged(k: int, synced: float = synced) -> float:
            return synced + k * per_token[0]

        costs.drafting[name] = drafting_costs(
            {k: share * plain[0] for k, share in shares.items()}, charged, engine.max_adaptive_depth
        )
    return costs


def _cache_path(engine: Engine) -> Path:
    """Where ``engine``'s calibration is cached: keyed by the checkpoint (path, size and
    time of its files), the machine, the BLAS and the engine's shape (the file's name ends
    with the key, ``_cache_key``)."""
    return mtplx_home() / "calibration" / f"{engine.model_name}-{_cache_key(engine)}.json"


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


def plain_step_seconds(engine: Engine, rounds: int = 3) -> float:
    """The median seconds of a plain step of one scratch row, timed as ``calibrate`` does."""
    return time_steps(engine, 1, (0,), rounds)[0]


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
    its depth, and finite seconds (positive plain steps, non-negative other than a drafting
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
            "this run only, and every start measures them again (make MTPLX_HOME writable "
            "to keep them)",
            path.parent,
            unwritable,
        )
    logger.info("measuring the step costs of this machine for %s", engine.model_name)
    started, cpu_before = time.perf_counter(), host_load.snapshot()
    costs = calibrate(engine)
    load = host_load.background_load(cpu_before, host_load.snapshot())
    logger.info(
        "step costs measured in %.1f s: plain %s ms, per token %s ms, drafting %s",
        time.perf_counter() - started,
        [round(c * 1e3, 1) for c in costs.plain],
        [round(c * 1e3, 1) for c in costs.per_token],
        {k: [round(c * 1e3, 1) for c in v] for k, v in costs.drafting.items()},
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
