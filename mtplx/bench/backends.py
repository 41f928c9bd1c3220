"""What the benchmark times: our engine; mlx-lm's own ``stream_generate`` (plain, and
speculative with the same layer-skip draft model wrapped as an mlx-lm model); and, where
llama-cpp-python is installed (``make install-llamacpp``), llama.cpp on the model's GGUF and
on a float32 copy of it (equal precision with our float32 checkpoint).

All are timed the same way: time to first token from the call, then decode tokens/s over
the tokens after the first (time from the first token to the last).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from mtplx.engine import Engine
from mtplx.models.target import LayerSkipDraft, Trunk
from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig


@dataclass(frozen=True)
class Mode:
    """One benchmarked configuration. ``backend`` "ours" runs the engine with ``drafter`` /
    ``depth`` (None = adaptive), "ours-f32" the same on the model dequantized to float32;
    "mlxlm" runs stream_generate, speculative when depth > 0; "llamacpp" runs llama.cpp on
    the GGUF named by ``gguf`` ("native" or "f32")."""

    name: str
    backend: str
    drafter: str | None = None
    depth: int | None = 0
    gguf: str | None = None


@dataclass
class RunResult:
    """What one generation measured."""

    tokens: int
    ttft: float
    decode_time: float
    num_cycles: int = 0  # verify forwards that checked at least one draft token
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    peak_memory_mb: float | None = None  # MLX's peak; None where not measured (llama.cpp)
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time after the first."""
        return (self.tokens - 1) / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify forward over drafting cycles (1.0 without drafting)."""
        return (self.num_accepted + self.num_cycles) / self.num_cycles if self.num_cycles else 1.0


class MLXLMLayerSkipDraft(nn.Module):
    """The layer-skip draft as an mlx-lm model: ``.layers`` (so make_prompt_cache builds one
    KVCache per layer) and ``__call__(inputs, cache=None) -> logits``. It shares the target's
    weights and runs the very same forward as our DraftModelDrafter's, so both decoders draft
    with an identical model."""

    def __init__(self, trunk: Trunk, num_layers: int) -> None:
        super().__init__()
        self.layers = list(trunk.inner.layers[:num_layers])
        self._draft = LayerSkipDraft(trunk, num_layers)  # not a Module: no parameter copy

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        if cache is None:
            cache = [None] * len(self.layers)
        logits, _ = self._draft(inputs, cache)
        return logits


def _reset_peak() -> None:
    with contextlib.suppress(AttributeError):  # older MLX: no peak tracking, report 0
        mx.reset_peak_memory()


def _peak_mb() -> float:
    try:
        return mx.get_peak_memory() / 2**20
    except AttributeError:
        return 0.0


def run_ours(
    engine: Engine, mode: Mode, prompt_ids: list[int], sampler: SamplerConfig, max_tokens: int
) -> RunResult:
    """One generation on our engine; EOS ignored so every mode decodes ``max_tokens``."""
    request = GenerationRequest(
        prompt_ids,
        sampler,
        max_tokens=max_tokens,
        drafter=mode.drafter,
        depth=mode.depth,
        ignore_eos=True,
    )
    _reset_peak()
    token_ids: list[int] = []
    first = last = 0.0
    stats = None
    started = time.perf_counter()
    for event in engine.generate(request):
        if isinstance(event, FinishEvent):
            stats = event.stats
            break
        last = time.perf_counter()
        if not token_ids:
            first = last
        token_ids.append(event.token_id)
    assert stats is not None
    return RunResult(
        tokens=len(token_ids),
        ttft=first - started,
        decode_time=last - first,
        num_cycles=stats.num_drafts,
        num_accepted=stats.num_accepted_tokens,
        accepted_per_position=list(stats.accepted_per_position),
        drafted_per_position=list(stats.drafted_per_position),
        peak_memory_mb=_peak_mb(),
        token_ids=token_ids,
    )


@contextlib.contextmanager
def _no_eos(tokenizer: Any) -> Iterator[None]:
    """stream_generate stops at EOS and has no ignore_eos: hide the EOS ids meanwhile."""
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        tokenizer.eos_token_ids = saved


def mlxlm_sampler(config: SamplerConfig) -> Any:
    """mlx-lm's sampler for the same temperature / top-p / top-k (greedy at temperature 0)."""
    top_p = config.top_p if config.top_p < 1.0 else 0.0  # mlx-lm: 0 = off
    return make_sampler(temp=config.temperature, top_p=top_p, top_k=config.top_k)


def run_mlxlm(
    model: nn.Module,
    tokenizer: Any,
    mode: Mode,
    prompt_ids: list[int],
    sampler: SamplerConfig,
    max_tokens: int,
    draft: nn.Module | None = None,
) -> RunResult:
    """One generation with mlx-lm's stream_generate (speculative with ``draft`` and
    ``mode.depth`` draft tokens when depth > 0). Acceptance comes from ``from_draft``: every
    verify forward yields its accepted drafts, then exactly one target token."""
    if sampler.seed is not None:
        mx.random.seed(sampler.seed)
    kwargs: dict[str, Any] = {"sampler": mlxlm_sampler(sampler)}
    speculative = bool(mode.depth) and draft is not None
    if speculative:
        kwargs.update(draft_model=draft, num_draft_tokens=mode.depth)
    _reset_peak()
    token_ids: list[int] = []
    from_draft: list[bool] = []
    first = last = 0.0
    started = time.perf_counter()
    with _no_eos(tokenizer):
        for response in stream_generate(
            model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, **kwargs
        ):
            last = time.perf_counter()
            if not token_ids:
                first = last
            token_ids.append(int(response.token))
            from_draft.append(bool(response.from_draft))
    result = RunResult(
        tokens=len(token_ids),
        ttft=first - started,
        decode_time=last - first,
        peak_memory_mb=_peak_mb(),
        token_ids=token_ids,
    )
    if speculative:
        _count_cycles(result, from_draft, int(mode.depth or 0))
    return result


def _count_cycles(result: RunResult, from_draft: list[bool], depth: int) -> None:
    """Rebuild the cycles from the from_draft flags: a run of drafted tokens closed by one
    target token. Each cycle drafted ``depth`` tokens (mlx-lm always drafts the full k
    until the max_tokens tail), of which the run's length were accepted."""
    accepted = [0] * depth
    drafted = [0] * depth
    run = 0
    for flag in from_draft:
        if flag:
            run += 1
            continue
        result.num_cycles += 1
        result.num_accepted += run
        for position in range(depth):
            drafted[position] += 1
            accepted[position] += position < run
        run = 0
    result.accepted_per_position = accepted
    result.drafted_per_position = drafted


def load_llamacpp(gguf_path: Path, n_ctx: int) -> Any:
    """llama-cpp-python's ``Llama`` on ``gguf_path``, CPU threads = our CPU count (MLX's
    OpenBLAS uses them all too). Raises ImportError where llama-cpp-python is missing."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)


def run_llamacpp(
    llm: Any, prompt_ids: list[int], sampler: SamplerConfig, max_tokens: int
) -> RunResult:
    """One generation with llama.cpp (``Llama.generate``, which decodes past EOS) on the
    same prompt ids: greedy at temperature 0, else its sampler chain with the same
    temperature / top-p / top-k and min-p and the repeat penalty off."""
    if sampler.seed is not None:
        llm.set_seed(sampler.seed)
    token_ids: list[int] = []
    first = last = 0.0
    started = time.perf_counter()
    for token in llm.generate(
        prompt_ids,
        temp=sampler.temperature,
        top_p=sampler.top_p,
        top_k=sampler.top_k,
        min_p=0.0,
        repeat_penalty=1.0,
        reset=True,
    ):
        last = time.perf_counter()
        if not token_ids:
            first = last
        token_ids.append(int(token))
        if len(token_ids) >= max_tokens:
            break
    return RunResult(
        tokens=len(token_ids), ttft=first - started, decode_time=last - first, token_ids=token_ids
    )
