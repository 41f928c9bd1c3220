"""What goes into the engine and what comes out of it: a generation request with its sampler
settings, the token events it yields, and the finish event with its speculative statistics.

MLX-free by design: the HTTP layer (``server/``) builds and reads these types without
loading MLX (tests/test_package.py imports the app with ``mlx`` blocked). Keep imports here
to the standard library and the other MLX-free modules (``mtplx.errors``, ``mtplx.grammar``,
``mtplx.drafter_registry``)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mtplx.drafter_registry import DRAFTER_NAMES
from mtplx.errors import InvalidParameter
from mtplx.grammar import GrammarSpec

MAX_DEPTH = 16

# OpenAI's documented ranges; a value outside them is a client error, not something to clamp.
_PENALTY_RANGE = (-2.0, 2.0)
_LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Below this temperature softmax((logits - max) / T) is the argmax to float32's precision
# (the MLX path's dtype), so it samples greedily.
_GREEDY_BELOW = 1e-30


def _check_finite(name: str, value: Any, param: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(param or name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParameter(param or name, f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplerConfig:
    """How one request samples. Validated on construction; errors name the field.

    Defaults match the OpenAI API: temperature 1, top_p 1, every other filter and penalty off.
    ``temperature == 0`` means greedy (argmax, ties to the lowest token id), as does a
    temperature below 1e-30 (it becomes 0).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = _check_finite("temperature", self.temperature)
        if temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {temperature}")
        if temperature < _GREEDY_BELOW:
            temperature = 0.0
        top_p = _check_finite("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameter(
                "top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        min_p = _check_finite("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_finite(name, getattr(self, name))
            if not _PENALTY_RANGE[0] <= value <= _PENALTY_RANGE[1]:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {value}")
        repetition_penalty = _check_finite("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise InvalidParameter(
                "repetition_penalty", f"repetition_penalty must be > 0, got {repetition_penalty}"
            )
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidParameter(
                "logit_bias",
                f"logit_bias must be a mapping token id -> bias, got {self.logit_bias!r}",
            )
        bias: dict[int, float] = {}
        for token_id, value in self.logit_bias.items():
            # str.isdigit() also accepts digits int() refuses ("²"): ASCII digits only.
            is_decimal = isinstance(token_id, str) and token_id.isascii() and token_id.isdigit()
            token = int(token_id) if is_decimal else token_id
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidParameter(
                    "logit_bias", f"logit_bias keys must be token ids >= 0, got {token_id!r}"
                )
            value = _check_finite(f"logit_bias[{token}]", value, "logit_bias")
            if not _LOGIT_BIAS_RANGE[0] <= value <= _LOGIT_BIAS_RANGE[1]:
                raise InvalidParameter(
                    "logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {value}"
                )
            bias[token] = value
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            # The seed feeds numpy.random.default_rng([seed, position]): non-negative only.
            raise InvalidParameter(
                "seed", f"seed must be an integer >= 0 or None, got {self.seed!r}"
            )
        for name, value in (
            ("temperature", temperature),
            ("top_p", top_p),
            ("min_p", min_p),
            ("repetition_penalty", repetition_penalty),
        ):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "logit_bias", types.MappingProxyType(bias))

    @property
    def is_greedy(self) -> bool:
        """True when sampling is a deterministic argmax."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when the distribution depends on the tokens generated so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate.

    ``drafter`` None means the engine's default drafter; ``depth`` None means the adaptive
    depth policy, an integer a fixed number of draft tokens per cycle (0 = plain decoding).
    ``logprobs`` None means no logprobs; k >= 0 means the sampled token's logprob plus the
    k most likely alternatives (OpenAI's ``top_logprobs``). ``grammar`` constrains the
    output (JSON, a JSON schema, a regex, a Lark grammar); it is checked and compiled by
    ``Engine.prepare`` (or ``Engine.add``), off the event loop. ``starts_reply``: the output
    is a reply of its own (a chat turn), whose leading word-initial space is dropped as
    decoding it alone would; False: it continues the prompt's text, and its text is exactly
    the concatenation of its tokens' text. ``prompt_logprobs`` k: score the prompt too,
    each prompt token's logprob under the model given the tokens before it, plus the k most
    likely alternatives (``FinishEvent.prompt_logprobs``); ``max_tokens`` may then be 0,
    to score the prompt alone. ``close_within_budget``: a grammar's text completes within
    ``max_tokens`` (``mtplx.grammar_budget``); False leaves it to be cut.
    """

    prompt_ids: Sequence[int]
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    max_tokens: int = 256
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    drafter: str | None = None
    depth: int | None = None
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    starts_reply: bool = False
    prompt_logprobs: int | None = None
    close_within_budget: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidParameter(
                "max_tokens", f"max_tokens must be an integer, got {self.max_tokens!r}"
            )
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens < least:
            raise InvalidParameter(
                "max_tokens", f"max_tokens must be >= {least}, got {self.max_tokens}"
            )
        if len(self.prompt_ids) == 0:
            raise InvalidParameter("prompt_ids", "prompt_ids must not be empty")
        if self.drafter is not None and self.drafter not in DRAFTER_NAMES:
            raise InvalidParameter(
                "drafter", f"drafter must be one of {DRAFTER_NAMES}, got {self.drafter!r}"
            )
        if self.depth is not None and (
            isinstance(self.depth, bool)
            or not isinstance(self.depth, int)
            or not 0 <= self.depth <= MAX_DEPTH
        ):
            raise InvalidParameter(
                "depth", f"depth must be an integer in [0, {MAX_DEPTH}], got {self.depth!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidParameter(name, f"{name} must be in [0, 20], got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameter("stop", "stop must be a list of non-empty strings")


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored: its logprob given the tokens before it and its rank there
    (1: the most likely), None for the first token, which nothing predicts; and the most
    likely alternatives there."""

    token_id: int
    logprob: float | None
    rank: int | None = None
    top_logprobs: TopLogprobs = ()


@dataclass(frozen=True)
class TokenEvent:
    """One committed token. ``text`` is the detokenized piece it completes (may be empty
    while a multi-byte character is incomplete; never splits a UTF-8 character)."""

    token_id: int
    text: str
    drafted: bool  # an accepted draft token (False: recovered, bonus or plainly sampled)
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


@dataclass
class GenerationStats:
    """Per-request counters: the numbers vLLM and llama.cpp export for speculation."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose states came from the prefix cache
    completion_tokens: int = 0
    num_cycles: int = 0  # verify forwards (plain decoding steps count as cycles of depth 0)
    num_drafts: int = 0  # cycles that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    num_recovered: int = 0
    num_bonus: int = 0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify forward (accepted + 1), over drafting cycles."""
        if self.num_drafts == 0:
            return 1.0
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a generation. ``text`` is the tail the detokenizer or a possible
    stop-string prefix still held back; it belongs after the last token's text.
    ``stop_sequence`` is the stop string that ended the generation (None when EOS, a stop
    token or a length limit ended it)."""

    finish_reason: Literal["stop", "length"]
    stats: GenerationStats
    text: str = ""
    stop_sequence: str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # when the request scored it
