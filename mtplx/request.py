"""What goes into the engine and what comes out of it: a generation request, the token
events it yields, and the finish event with its speculative statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from mtplx.errors import InvalidParameter
from mtplx.grammar import GrammarSpec
from mtplx.sampling import SamplerConfig

DRAFTER_NAMES = ("mtp+ngram", "draft_model+ngram", "mtp", "draft_model", "ngram", "none")
MAX_DEPTH = 16


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
