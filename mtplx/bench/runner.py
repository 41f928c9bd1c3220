"""The benchmark loop: paired, interleaved runs of every mode on the same model, prompts and
samplers, repeated with the mode order rotated each repeat.

Interleaving (all modes on one prompt back to back, before the next prompt) is what makes
the per-pair speedups meaningful on a shared machine: a change in background load lands on
the plain run and its partners alike, and rotating the order stops any mode from always
running first (cold caches) or last.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtplx.bench.backends import (
    MLXLMLayerSkipDraft,
    Mode,
    RunResult,
    load_llamacpp,
    run_llamacpp,
    run_mlxlm,
    run_ours,
)
from mtplx.bench.prompts import DEFAULT_PROMPT_DIR, encode_prompt, load_prompts
from mtplx.engine import Engine
from mtplx.models import LoadedModel, load, make_layer_skip_draft
from mtplx.models.gguf import write_f32_gguf
from mtplx.request import SamplerConfig

logger = logging.getLogger(__name__)

SAMPLERS = {
    "greedy": SamplerConfig(temperature=0.0),
    "t0.6": SamplerConfig(temperature=0.6, top_p=0.95, top_k=20),
}
ALL_MODES = (
    "plain", "plain-f32", "default", "mtp", "draft", "ngram", "mlxlm-plain", "mlxlm-spec",
    "llamacpp",
)  # fmt: skip


@dataclass
class BenchConfig:
    """Everything a benchmark run depends on (recorded verbatim in the JSON)."""

    model: str
    max_tokens: int = 128
    repeats: int = 3
    samplers: Sequence[str] = ("greedy", "t0.6")
    categories: Sequence[str] | None = None  # None: every prompt file
    prompts_per_category: int | None = None
    modes: Sequence[str] = ALL_MODES  # families; "mtp" expands to mtp@1..mtp_depths
    mtp_depths: int = 5
    draft_depth: int = 3  # draft tokens per cycle for ours and mlx-lm's draft-model modes
    ngram_depth: int = 4
    draft_layers: int | None = None  # None: chosen by measurement
    draft_layer_candidates: Sequence[int] | None = None
    prompt_dir: str = str(DEFAULT_PROMPT_DIR)
    gguf: str | None = None  # llama.cpp's model; None: the GGUF the checkpoint came from
    seed: int = 0
    progress: bool = True


@dataclass
class BenchResult:
    """The raw records plus what the summary and report need about the run."""

    config: dict[str, Any]
    machine: dict[str, Any]
    draft_layers: int | None
    draft_calibration: dict[int, float]
    modes: list[dict[str, Any]]
    llamacpp: dict[str, str] = field(default_factory=dict)  # llama.cpp rows: variant -> GGUF
    records: list[dict[str, Any]] = field(default_factory=list)
    started: str = ""
    elapsed_s: float = 0.0


def expand_modes(
    config: BenchConfig, engine: Engine, llamacpp_ggufs: dict[str, Path] | None = None
) -> list[Mode]:
    """The concrete modes for the families in ``config.modes`` that this model supports
    (no MTP heads: no mtp rows; no llama-like trunk: no draft-model rows; llama.cpp rows
    for each of ``llamacpp_ggufs``)."""
    available = set(engine.available_drafters)
    modes: list[Mode] = []
    for family in config.modes:
        if family == "plain":
            modes.append(Mode("plain", "ours", "none", 0))
        elif family == "plain-f32":
            # The same model dequantized to float32 (only when it is served quantized).
            if getattr(getattr(engine, "model", None), "weights", "float32") != "float32":
                modes.append(Mode("plain-f32", "ours-f32", "none", 0))
        elif family == "default":
            modes.append(Mode("default", "ours", None, None))
        elif family == "mtp" and "mtp" in available:
            modes += [Mode(f"mtp@{k}", "ours", "mtp", k) for k in range(1, config.mtp_depths + 1)]
        elif family.startswith("mtp@") and "mtp" in available:
            modes.append(Mode(family, "ours", "mtp", int(family[4:])))
        elif family == "mtp-adaptive" and "mtp" in available:
            modes.append(Mode(family, "ours", "mtp", None))
        elif family == "draft" and "draft_model" in available:
            modes.append(
                Mode(f"draft@{config.draft_depth}", "ours", "draft_model", config.draft_depth)
            )
        elif family == "ngram":
            modes.append(Mode(f"ngram@{config.ngram_depth}", "ours", "ngram", config.ngram_depth))
        elif family == "mlxlm-plain":
            modes.append(Mode("mlxlm-plain", "mlxlm", None, 0))
        elif family == "mlxlm-spec" and "draft_model" in available:
            modes.append(
                Mode(f"mlxlm-spec@{config.draft_depth}", "mlxlm", None, config.draft_depth)
            )
        elif family == "llamacpp":
            modes += [Mode(f"llamacpp-{v}", "llamacpp", gguf=v) for v in llamacpp_ggufs or {}]
        elif family not in (*ALL_MODES, "mtp-adaptive") and not family.startswith("mtp@"):
            raise ValueError(f"unknown mode {family!r}; known: {', '.join(ALL_MODES)}")
    if not any(m.name == "plain" for m in modes):
        modes.insert(0, Mode("plain", "ours", "none", 0))  # every speedup is over it
    return modes


def choose_draft_layers(
    loaded: LoadedModel,
    prompt_ids: list[int],
    depth: int,
    max_tokens: int,
    candidates: Sequence[int] | None = None,
) -> tuple[int, dict[int, float]]:
    """The layer-skip depth N with the best measured greedy decode speed on one prompt
    (after one warm-up each), over candidates spread through the trunk."""
    total = len(loaded.target.trunk.inner.layers)  # type: ignore[attr-defined]
    if candidates is None:
        candidates = sorted({max(1, round(total * f)) for f in (0.125, 0.25, 0.4)})
    speeds: dict[int, float] = {}
    for layers in candidates:
        engine = Engine(loaded, draft_model=make_layer_skip_draft(loaded, layers))
        mode = Mode("calibrate", "ours", "draft_model", depth)
        run_ours(engine, mode, prompt_ids, SAMPLERS["greedy"], 4)  # warm-up
        speeds[layers] = run_ours(
            engine, mode, prompt_ids, SAMPLERS["greedy"], max_tokens
        ).decode_tps
    return max(speeds, key=lambda n: speeds[n]), speeds


def machine_info() -> dict[str, Any]:
    """CPU model and cores, BLAS, load average, MLX and Python versions."""
    from mtplx.blas import blas_info

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": _blas_dict(blas_info()),
    }
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except (ImportError, AttributeError):
        pass
    if importlib.util.find_spec("llama_cpp") is not None:
        from importlib.metadata import version

        info["llama_cpp"] = version("llama_cpp_python")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        info["cpu_model"] = names[0] if names else platform.processor()
        info["cpus"] = len(names)
    info["lscpu"] = _lscpu()
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total_kb = int(meminfo.read_text().split()[1])  # first line: MemTotal: N kB
        info["memory_gb"] = round(total_kb / 2**20, 1)
    info["load_average"] = _loadavg()
    return info


def _lscpu() -> dict[str, str]:
    """The lscpu lines that identify the CPU (empty where lscpu is missing)."""
    import subprocess

    keys = (
        "Model name",
        "CPU family",
        "Model",
        "Thread(s) per core",
        "Core(s) per socket",
        "Hypervisor vendor",
        "L3 cache",
    )
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in keys if k in fields}


def _blas_dict(blas: Any) -> dict[str, Any]:
    return {k: getattr(blas, k) for k in ("name", "library", "threads", "fast", "fallback_reason")}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        return None


def run_bench(
    config: BenchConfig,
    loaded: LoadedModel | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> BenchResult:
    """Run the whole benchmark and return every record; ``on_record`` sees each record as
    it is made (the CLI appends them to records.jsonl, so an interrupted run keeps its data)."""
    started = time.time()
    loaded = loaded or load(config.model)
    prompts = load_prompts(Path(config.prompt_dir), config.categories, config.prompts_per_category)
    encoded = {p.prompt_id: encode_prompt(loaded.tokenizer, p.text) for p in prompts}
    draft_layers, calibration = _pick_draft_layers(config, loaded, encoded[prompts[0].prompt_id])
    draft = make_layer_skip_draft(loaded, draft_layers) if draft_layers else None
    engine = Engine(loaded, draft_model=draft)
    if any(m.backend == "ours" and m.depth is None for m in expand_modes(config, engine, {})):
        # What `mtplx serve` does before its first request: the adaptive policy prices depths
        # with this machine's measured step costs (cached), not the engine's fallback table.
        engine.warm_up()
    ggufs = llamacpp_ggufs(config) if "llamacpp" in config.modes else {}
    longest = max(len(ids) for ids in encoded.values()) + config.max_tokens
    llamacpp = {variant: load_llamacpp(path, longest + 16) for variant, path in ggufs.items()}
    modes = expand_modes(config, engine, ggufs)
    # plain-f32: the same checkpoint with its quantized weights dequantized to float32.
    engine_f32 = (
        Engine(load(config.model, dequantize=True))
        if any(m.backend == "ours-f32" for m in modes)
        else None
    )
    trunk = loaded.target.trunk  # type: ignore[attr-defined]
    mlx_draft = MLXLMLayerSkipDraft(trunk, draft_layers) if draft_layers else None

    def run(mode: Mode, prompt_ids: list[int], sampler: SamplerConfig, tokens: int) -> RunResult:
        if mode.backend == "llamacpp":
            return run_llamacpp(llamacpp[mode.gguf or ""], prompt_ids, sampler, tokens)
        if mode.backend == "mlxlm":
            return run_mlxlm(
                trunk.model, loaded.tokenizer, mode, prompt_ids, sampler, tokens, mlx_draft
            )
        if mode.backend == "ours-f32":
            assert engine_f32 is not None
            return run_ours(engine_f32, mode, prompt_ids, sampler, tokens)
        return run_ours(engine, mode, prompt_ids, sampler, tokens)

    # Warm-up: compiles/allocates each path once, so that does not land in a timed run.
    first_ids = encoded[prompts[0].prompt_id]
    for mode in modes:
        for sampler_name in config.samplers:
            run(mode, first_ids, SAMPLERS[sampler_name], 8)

    result = BenchResult(
        config=asdict(config),
        machine=machine_info(),
        draft_layers=draft_layers,
        draft_calibration=calibration,
        modes=[asdict(m) for m in modes],
        llamacpp={variant: str(path) for variant, path in ggufs.items()},
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    )
    total = config.repeats * len(config.samplers) * len(prompts) * len(modes)
    with _Progress(total, config.progress) as tick:
        for repeat in range(config.repeats):
            shift = repeat % len(modes)
            order = modes[shift:] + modes[:shift]
            for sampler_name in config.samplers:
                for index, prompt in enumerate(prompts):
                    seed = config.seed + 1000 * repeat + index
                    sampler = _seeded(SAMPLERS[sampler_name], seed)
                    for mode in order:
                        outcome = run(mode, encoded[prompt.prompt_id], sampler, config.max_tokens)
                        record = _record(mode, prompt, sampler_name, repeat, outcome)
                        result.records.append(record)
                        if on_record is not None:
                            on_record(record)
                        tick(f"{sampler_name} {prompt.prompt_id} {mode.name}")
    result.machine["load_average_end"] = _loadavg()
    result.elapsed_s = time.time() - started
    return result


def llamacpp_ggufs(config: BenchConfig) -> dict[str, Path]:
    """llama.cpp's models: "native", the GGUF the checkpoint was converted from (or
    ``config.gguf``), and "f32", a float32 copy of it written once next to the checkpoint
    (the precision of our dequantized weights). Empty, with the reason logged, where
    llama-cpp-python is not installed or the GGUF is unknown."""
    if importlib.util.find_spec("llama_cpp") is None:
        logger.warning(
            "no llama.cpp rows: llama-cpp-python is not installed (make install-llamacpp)"
        )
        return {}
    source = Path(config.model) / "mtplx_source.json"
    if config.gguf is not None:
        native = Path(config.gguf)
    elif source.is_file():
        native = Path(json.loads(source.read_text())["gguf"])
    else:
        logger.warning(
            "no llama.cpp rows: %s was not converted from a GGUF (pass --gguf)", config.model
        )
        return {}
    f32 = Path(config.model).parent / f"{native.stem}.f32.gguf"
    if not f32.is_file():
        write_f32_gguf(native, f32)
    return {"native": native, "f32": f32}


def _pick_draft_layers(
    config: BenchConfig, loaded: LoadedModel, prompt_ids: list[int]
) -> tuple[int | None, dict[int, float]]:
    wants_draft = any(m in ("draft", "mlxlm-spec") for m in config.modes)
    if not wants_draft:
        return None, {}
    if config.draft_layers is not None:
        return config.draft_layers, {}
    try:
        return choose_draft_layers(
            loaded,
            prompt_ids,
            config.draft_depth,
            min(config.max_tokens, 32),
            config.draft_layer_candidates,
        )
    except ValueError:  # not a llama-like trunk: no layer-skip draft for this model
        return None, {}


def _seeded(config: SamplerConfig, seed: int) -> SamplerConfig:
    """``config`` with ``seed``: every mode of a pair samples from the same seed."""
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    return SamplerConfig(**{**fields, "seed": seed})


def _record(mode: Mode, prompt: Any, sampler: str, repeat: int, run: RunResult) -> dict[str, Any]:
    return {
        "mode": mode.name,
        "backend": mode.backend,
        "sampler": sampler,
        "category": prompt.category,
        "prompt_id": prompt.prompt_id,
        "repeat": repeat,
        "tokens": run.tokens,
        "ttft_s": run.ttft,
        "decode_time_s": run.decode_time,
        "decode_tps": run.decode_tps,
        "num_cycles": run.num_cycles,
        "num_accepted": run.num_accepted,
        "mean_acceptance_length": run.mean_acceptance_length,
        "accepted_per_position": run.accepted_per_position,
        "drafted_per_position": run.drafted_per_position,
        "peak_memory_mb": run.peak_memory_mb,
        "token_ids": run.token_ids,
    }


class _Progress:
    """A tqdm bar on stderr (a no-op callable when disabled or tqdm is missing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def __enter__(self) -> Callable[[str], None]:
        def tick(label: str) -> None:
            if self.bar is not None:
                self.bar.set_postfix_str(label, refresh=False)
                self.bar.update(1)

        return tick

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
