"""A deterministic stand-in for ``mtplx.engine.Engine`` and its tokenizer, for bridge and
server tests. It follows the engine API exactly (validate / generate / token_text and the
attributes the server reads) so the real engine drops in without touching the tests' logic.

Tokens are UTF-8 bytes (ids 0..255) plus an end-of-sequence token, so multi-byte characters
span several tokens and exercise the "text never splits a character" rule. The output is a
pseudo-random word sequence seeded by (prompt, seed): the same request always yields the same
tokens, and two different prompts yield different ones, so mixed streams are detectable.

Prompt markers steer it: ``[[fail]]`` raises after two tokens, ``[[eos]]`` ends with the
end-of-sequence token after five. ``ScriptedEngine`` answers a fixed text instead, with a
reasoning model's chat template (``ThinkingTokenizer``).
"""

from __future__ import annotations

import codecs
import random
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from mtplx.grammar import check_grammar
from mtplx.request import FinishEvent, GenerationRequest, GenerationStats, TokenEvent
from tests.fixtures.tokenizer import thinking_chat_template

EOS_ID = 256
VOCAB_SIZE = 257
WORDS = ("hello", "speculative", "naïve", "ünïcödé", "🙂", "日本", "token", "draft", "verify")
DRAFTS_PER_CYCLE = 3  # every cycle: three accepted draft tokens, then one recovered/bonus


class FakeTokenizer:
    """Byte-level tokenizer with the slice of mlx-lm's TokenizerWrapper the server uses."""

    eos_token_ids = frozenset({EOS_ID})
    eos_token_id = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of byte tokens; special tokens are dropped."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        """A ChatML-like template: ``<|role|>content`` lines, then ``<|assistant|>``."""
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Token strings, byte-fallback style for non-ASCII bytes."""
        return [_token_string(i) for i in ids]


def _token_string(token_id: int) -> str:
    if token_id == EOS_ID:
        return "<eos>"
    if token_id < 128:
        return chr(token_id)
    return f"<0x{token_id:02X}>"


class FakeSequence:
    """A row of the fake engine's batch: its request, the caller's tag, its event stream."""

    def __init__(self, request: GenerationRequest, tag: object, events: Iterator) -> None:
        self.request = request
        self.tag = tag
        self.events = events


class FakeEngine:
    """Deterministic engine double. ``token_delay`` sleeps per token (one "cycle" per token
    as far as cancellation is concerned). ``requests`` records every request generated and
    ``log`` the (event, prompt) trail; ``max_concurrent`` checks single-threaded use."""

    def __init__(
        self,
        *,
        context_length: int = 4096,
        token_delay: float = 0.0,
        model_name: str = "fake-model",
        available_drafters: tuple[str, ...] = ("mtp", "ngram", "none"),
        default_drafter: str = "mtp",
        default_depth: int | None = 3,
        max_num_seqs: int = 4,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.vocab_size = VOCAB_SIZE
        self.model_name = model_name
        self.context_length = context_length
        self.default_drafter = default_drafter
        self.default_depth = default_depth
        self.available_drafters = available_drafters
        self.token_delay = token_delay
        self.requests: list[GenerationRequest] = []
        self.log: list[tuple[str, str]] = []
        self.max_concurrent = 0
        self.max_num_seqs = max_num_seqs
        self.running: list[FakeSequence] = []
        self.threads: set[int] = set()  # the threads that called add / step / abort
        self.num_steps = 0
        self.num_orphan_rows = 0  # rows held for no request: a test may pretend a leak
        self._running = 0
        self._lock = threading.Lock()

    # -- the batch API the bridge uses: each row advances one event per step -----------

    @property
    def has_room(self) -> bool:
        """Whether another sequence can join the batch."""
        return len(self.running) < self.max_num_seqs

    def has_room_for(self, request: GenerationRequest) -> bool:
        """Whether ``request`` can join the batch (a free slot: the fake holds no KV)."""
        return self.has_room

    def add(self, request: GenerationRequest, tag: object = None) -> FakeSequence:
        """Start ``request`` as a row of the batch."""
        self.threads.add(threading.get_ident())
        self.validate(request)
        if not self.has_room:
            raise RuntimeError("the batch is full")
        sequence = FakeSequence(request, tag, self.generate(request))
        self.running.append(sequence)
        return sequence

    def step(self) -> list[tuple[FakeSequence, TokenEvent | FinishEvent | BaseException]]:
        """One event from every row (one token delay for the whole step)."""
        self.threads.add(threading.get_ident())
        self.num_steps += 1
        events: list[tuple[FakeSequence, TokenEvent | FinishEvent | BaseException]] = []
        for sequence in list(self.running):
            try:
                event = next(sequence.events)
            except Exception as exc:  # a failing row fails alone
                self.abort(sequence)
                events.append((sequence, exc))
                continue
            events.append((sequence, event))
            if isinstance(event, FinishEvent):
                self.abort(sequence)
        return events

    def abort(self, sequence: FakeSequence) -> None:
        """Drop a row (closing its generator logs "closed" when it had not finished)."""
        self.threads.add(threading.get_ident())
        if sequence in self.running:
            self.running.remove(sequence)
            sequence.events.close()

    def validate(self, request: GenerationRequest) -> None:
        """Reject what the real engine rejects before doing any work."""
        if len(request.prompt_ids) >= self.context_length:
            raise ValueError(
                f"prompt is {len(request.prompt_ids)} tokens, over the context length "
                f"{self.context_length}"
            )
        if request.drafter is not None and request.drafter not in self.available_drafters:
            raise ValueError(
                f"drafter {request.drafter!r} is not available for this model "
                f"(available: {', '.join(self.available_drafters)})"
            )
        for token_id in request.sampler.logit_bias:
            if token_id >= VOCAB_SIZE:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary")

    def prepare(self, request: GenerationRequest) -> None:
        """Check the request's grammar, as the real engine does (it also compiles it)."""
        if request.grammar is not None:
            check_grammar(request.grammar)

    def token_text(self, token_id: int) -> str:
        """Text of one token, for top_logprobs."""
        return _token_string(token_id)

    def plan(self, request: GenerationRequest) -> tuple[list[int], str]:
        """The tokens this request will produce and its finish reason."""
        tokens, reason, _ = self.plan_with_stop(request)
        return tokens, reason

    def plan_with_stop(self, request: GenerationRequest) -> tuple[list[int], str, str | None]:
        """``plan`` and the stop string that ended the output (None if none did)."""
        prompt = bytes(i for i in request.prompt_ids if i < 256)
        sampler = request.sampler
        if sampler.seed is not None or sampler.is_greedy:
            rng = random.Random(f"{prompt!r}|{sampler.seed}|{sampler.temperature}")
        else:
            rng = random.Random()
        words = [rng.choice(WORDS) for _ in range(request.max_tokens + 1)]
        tokens = list(" ".join(words).encode("utf-8"))
        if b"[[eos]]" in prompt:
            tokens = [*tokens[:5], EOS_ID]
        text = b""
        stops = [s.encode("utf-8") for s in request.stop]
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        for i, token in enumerate(tokens[: request.max_tokens]):
            if token in stop_ids:
                return tokens[:i], "stop", None
            text += bytes([token])
            for n, stop in enumerate(stops):
                if stop in text:
                    # Cut the stop string and everything after it, as the engine does.
                    keep = text.index(stop)
                    return tokens[:keep], "stop", request.stop[n]
        return tokens[: request.max_tokens], "length", None

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent | FinishEvent]:
        """Yield one TokenEvent per token, then a FinishEvent with speculative stats."""
        label = self.tokenizer.decode(request.prompt_ids)
        with self._lock:
            self._running += 1
            self.max_concurrent = max(self.max_concurrent, self._running)
            self.requests.append(request)
            self.log.append(("start", label))
        try:
            tokens, reason, stop_sequence = self.plan_with_stop(request)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
            depth = DRAFTS_PER_CYCLE
            stats.drafted_per_position = [0] * depth
            stats.accepted_per_position = [0] * depth
            for i, token in enumerate(tokens):
                if b"[[fail]]" in label.encode("utf-8") and i == 2:
                    raise RuntimeError("fake engine failure")
                if self.token_delay:
                    time.sleep(self.token_delay / max(1, len(self.running)))
                position = i % (depth + 1)
                if position == 0:
                    stats.num_cycles += 1
                    stats.num_drafts += 1
                    stats.num_draft_tokens += depth
                    for p in range(depth):
                        stats.drafted_per_position[p] += 1
                drafted = position < depth
                if drafted:
                    stats.num_accepted_tokens += 1
                    stats.accepted_per_position[position] += 1
                else:
                    stats.num_bonus += 1
                stats.completion_tokens += 1
                logprob, top = None, None
                if request.logprobs is not None:
                    logprob = -0.25 * (1 + position)
                    alternatives = [(t, logprob - 1.0 - j) for j, t in enumerate((65, 66, 67))]
                    top = ((token, logprob), *alternatives)[: request.logprobs]
                yield TokenEvent(
                    token_id=token,
                    text=decoder.decode(bytes([token])),
                    drafted=drafted,
                    logprob=logprob,
                    top_logprobs=top,
                )
            with self._lock:
                self.log.append(("finished", label))
            # Like the engine's detokenizer: bytes of a character cut short by the end of
            # the generation come out at the finish, as U+FFFD.
            tail = decoder.decode(b"", final=True)
            yield FinishEvent(
                finish_reason=reason,  # type: ignore[arg-type]
                stats=stats,
                text=tail,
                stop_sequence=stop_sequence,
            )
        except GeneratorExit:
            with self._lock:
                self.log.append(("closed", label))
            raise
        finally:
            with self._lock:
                self._running -= 1

    def expected_text(self, request: GenerationRequest) -> str:
        """The full text ``generate`` produces for ``request`` (for assertions)."""
        tokens, _ = self.plan(request)
        # The token events' text plus the finish event's tail (U+FFFD for a cut character).
        return bytes(tokens).decode("utf-8", errors="replace")


class ThinkingTokenizer(FakeTokenizer):
    """The fake byte tokenizer with a Qwen3-style thinking template (tools rendered the
    Hermes way): records the template variables of every render."""

    def __init__(self, opens: bool = False) -> None:
        self.opens = opens
        self.always = False  # a template that thinks whatever enable_thinking says
        self.chat_template = thinking_chat_template(opens) + "{# tools <tool_call> #}"
        self.renders: list[dict[str, Any]] = []
        self.conversations: list[list[dict[str, Any]]] = []

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        self.renders.append(kwargs)
        self.conversations.append(list(messages))
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
            if self.always:
                text += "<think>\n"
            elif kwargs.get("enable_thinking") is False:
                text += "<think>\n\n</think>\n\n"
            elif self.opens:
                text += "<think>\n"
        return self.encode(text) if tokenize else text


class ScriptedEngine(FakeEngine):
    """The fake engine answering ``script`` (its UTF-8 bytes, one token each, cut at
    max_tokens) whatever the prompt."""

    def __init__(self, script: str, opens: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.script = script
        self.tokenizer = ThinkingTokenizer(opens)

    def plan_with_stop(self, request: GenerationRequest) -> tuple[list[int], str, str | None]:
        tokens = list(self.script.encode("utf-8"))
        if len(tokens) > request.max_tokens:
            return tokens[: request.max_tokens], "length", None
        return tokens, "stop", None


def install_fake_engine_modules(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-ins for mtplx.engine.Engine and mtplx.models.load, recording their calls."""
    calls: dict[str, Any] = {}

    class Engine(FakeEngine):
        def __init__(
            self, loaded, default_drafter="mtp", default_depth=None, draft_model=None, **sizes
        ):
            calls["engine"] = (loaded.path, default_drafter, default_depth)
            calls["sizes"] = sizes
            super().__init__(default_drafter=default_drafter, default_depth=default_depth)

        def warm_up(self):
            calls["warm_up"] = True

    engine_module = types.ModuleType("mtplx.engine")
    engine_module.Engine = Engine
    monkeypatch.setitem(sys.modules, "mtplx.engine", engine_module)
    import mtplx.models

    def load(path):
        return types.SimpleNamespace(path=f"loaded:{path}", mtp_heads=["head"])

    monkeypatch.setattr(mtplx.models, "load", load, raising=False)
    return calls
