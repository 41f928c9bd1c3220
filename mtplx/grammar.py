"""Constrained decoding: grammars (JSON object, JSON Schema, regex, Lark) over a model's
tokenizer, and the per-sequence grammar state the sampler masks with.

The grammar engine is llguidance (``LLMatcher``): no dependencies of its own, a token mask
in tens of microseconds for a 49k vocabulary, broad JSON Schema coverage, and ``rollback``,
which is what speculative decoding needs (draft tokens advance the state, rejected ones are
rolled back). See the "Constrained decoding" section of README.md for the choice.

The mask a grammar puts on the target distribution at a state is ``allowed()``: the tokens
the grammar accepts next, plus the sequence's stop tokens (EOS, ``stop_token_ids``) when the
grammar is complete. A grammar that is complete with no continuation (``finished``) ends the
sequence: plain constrained decoding would sample a stop token with probability one there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from mtplx import grammar_budget, grammar_check
from mtplx.errors import InvalidParameter
from mtplx.grammar_budget import ClosingIndex, Word, closing_text, closing_tokens, schema_words

__all__ = [
    "MAX_GRAMMAR_CHARS",
    "GrammarCompiler",
    "GrammarSpec",
    "GrammarState",
    "check_grammar",
    "grammar_thread",
]

GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]
T = TypeVar("T")
_CACHE_SIZE = 64  # compiled grammars kept per tokenizer (schemas repeat across requests)
# The longest schema, regex or Lark grammar a request may carry. It bounds both the time a
# compile takes (llguidance's work grows with the grammar) and the depth its recursive
# descent can reach (a chain of references nests one call per link).
MAX_GRAMMAR_CHARS = 262_144
# llguidance compiles grammars by recursive descent, one native frame per nesting level,
# and overflows a default 8 MiB stack at a few thousand levels (a segfault, not an error).
# Grammars are compiled on one thread whose stack holds every grammar of MAX_GRAMMAR_CHARS
# (address space only: untouched pages are never committed).
_GRAMMAR_STACK_BYTES = grammar_check.STACK_BYTES
_MAX_MESSAGE_CHARS = 400
_MAX_WORDS = 32  # property names the closing walk tries (mtplx.grammar_budget)
# Grammars longer than this are checked in a process of their own, killed past
# GRAMMAR_CHECK_SECONDS: some compile in time that grows as a power of their size.
ISOLATE_ABOVE_CHARS = 2_048
GRAMMAR_CHECK_SECONDS = 5.0


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``source``: the JSON Schema as canonical
    JSON text, the regex or the Lark grammar; ``param``: the API field to name in errors."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"
    # Filled by GrammarCompiler.compile (not part of the value): (compiler, matcher), so that
    # a request's matcher stays with it from admission until the engine thread adds it,
    # whatever the compiler's cache evicts meanwhile (a recompile there would hold up the
    # batch behind every grammar queued on the grammar thread).
    compiled: tuple[Any, Any] | None = field(
        default=None, init=False, compare=False, hash=False, repr=False
    )

    @classmethod
    def json_object(cls, param: str = "response_format") -> GrammarSpec:
        """Any JSON object."""
        return cls("json_object", "", param)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> GrammarSpec:
        """JSON text valid under ``schema`` (a dict, or a boolean schema)."""
        if not isinstance(schema, (dict, bool)):
            raise InvalidParameter(param, f"the JSON schema must be an object, got {schema!r}")
        # Key order kept: llguidance generates properties in the order the schema lists them.
        return cls("json_schema", json.dumps(schema), param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialised form."""
        return grammar_check.llguidance_grammar(self.kind, self.source)


_checked: OrderedDict[GrammarSpec, str] = OrderedDict()
_checked_lock = threading.Lock()
_thread_lock = threading.Lock()
_thread: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def grammar_thread() -> ThreadPoolExecutor:
    """The one thread that compiles grammars (started on first use, with a stack deep
    enough for any grammar within MAX_GRAMMAR_CHARS). Submitting to it keeps compiles off
    the event loop and off the engine thread."""
    global _thread, _thread_ident
    with _thread_lock:
        if _thread is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtplx-grammar")
            previous = threading.stack_size(_GRAMMAR_STACK_BYTES)
            try:  # the worker thread is created by the first submit, with this stack size
                _thread_ident = executor.submit(threading.get_ident).result()
            finally:
                threading.stack_size(previous)
            _thread = executor
        return _thread


def _on_grammar_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on the grammar thread; the caller waits for it."""
    executor = grammar_thread()
    if threading.get_ident() == _thread_ident:
        return function(*args)
    return executor.submit(function, *args).result()


def _check_limits(param: str, matcher: Any) -> None:
    """Raise when ``matcher`` is in error: the parser's own limits (masks only offer allowed
    tokens, so nothing else puts it there), as a request error naming the field ``param``."""
    if matcher.is_error():
        raise InvalidParameter(
            param,
            f"the grammar exceeds the parser's limits: {_plain(matcher.get_error())}",
            code="grammar_too_complex",
        )


def _plain(message: str) -> str:
    """An llguidance message fit for a client: one line, bounded. The reason may follow
    the first line (a regex error); a parser state dump or a Rust backtrace never goes."""
    lines = []
    for line in message.strip().splitlines():
        if line.lstrip().startswith(("<state>", "stack backtrace", "note: run with")):
            break
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines).replace("<non-verbose/>", "").strip() or "invalid"
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def _check_size(spec: GrammarSpec) -> None:
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        raise InvalidParameter(
            spec.param,
            f"the grammar is {len(spec.source):,} characters; at most {MAX_GRAMMAR_CHARS:,} "
            "are accepted",
            code="grammar_too_large",
        )


def check_grammar(spec: GrammarSpec) -> str:
    """Validate ``spec`` without a tokenizer (cached); its llguidance grammar. Raises
    InvalidParameter naming ``spec.param`` and the problem (an invalid schema, regex or
    grammar, or one over MAX_GRAMMAR_CHARS). The work runs on the grammar thread; the caller
    waits for it."""
    with _checked_lock:
        if spec in _checked:
            _checked.move_to_end(spec)
            return _checked[spec]
    _check_size(spec)
    grammar = _on_grammar_thread(_validate, spec)
    with _checked_lock:
        _checked[spec] = grammar
        while len(_checked) > _CACHE_SIZE:
            _checked.popitem(last=False)
    return grammar


def _validate(spec: GrammarSpec) -> str:
    what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex"}
    if len(spec.source) > ISOLATE_ABOVE_CHARS:
        grammar, error = _check_in_a_process(spec)
    else:
        grammar, error = grammar_check.check(spec.kind, spec.source)
    if error is not None:
        raise InvalidParameter(
            spec.param,
            f"invalid {what.get(spec.kind, 'grammar')}: {_plain(error)}",
            code="invalid_value",
        )
    return grammar


def _check_in_a_process(spec: GrammarSpec) -> tuple[str, str | None]:
    """``grammar_check.check`` in a child process, killed past GRAMMAR_CHECK_SECONDS."""
    request = json.dumps({"kind": spec.kind, "source": spec.source})
    try:
        done = subprocess.run(
            [sys.executable, "-I", grammar_check.__file__],
            input=request,
            capture_output=True,
            text=True,
            timeout=GRAMMAR_CHECK_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise InvalidParameter(
            spec.param,
            f"the grammar takes too long to compile (over {GRAMMAR_CHECK_SECONDS:g} s): "
            "simplify it",
            code="grammar_too_complex",
        ) from exc
    if done.returncode != 0:
        raise InvalidParameter(
            spec.param, "the grammar could not be compiled", code="grammar_too_complex"
        )
    result = json.loads(done.stdout)
    return result["grammar"], result["error"]


class GrammarCompiler:
    """Grammars for one model's tokenizer. The llguidance tokenizer (about a second to
    build for a 49k vocabulary) is made once, on first use; compiled grammars are cached by
    spec, and each sequence gets a cheap copy of the compiled matcher."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """tokenizer: mlx-lm's TokenizerWrapper (or a Hugging Face fast tokenizer);
        vocab_size: the model's logits width (may differ from the tokenizer's)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._closing_index: ClosingIndex | None = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the llguidance tokenizer now (server start), not in the first constrained
        request, where it would hold up the whole batch for about a second."""
        _on_grammar_thread(self._llguidance_tokenizer)

    def _llguidance_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            eos = sorted(getattr(self.tokenizer, "eos_token_ids", None) or []) or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled matcher of ``spec`` (cached): checked, then built against the
        tokenizer on the grammar thread. Raises InvalidParameter when ``spec`` is invalid or
        admits no output at all. The server calls it before admission, so that the engine
        thread finds the matcher ready."""
        if spec.compiled is not None and spec.compiled[0] is self:
            return spec.compiled[1]
        with self._lock:
            matcher = self._compiled.get(spec)
            if matcher is not None:
                self._compiled.move_to_end(spec)
        if matcher is None:
            grammar = check_grammar(spec)
            matcher = _on_grammar_thread(self._build, spec, grammar)
            with self._lock:
                self._compiled[spec] = matcher
                while len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
        object.__setattr__(spec, "compiled", (self, matcher))  # frozen: a cache slot
        return matcher

    def prepare(self, spec: GrammarSpec, budget: bool = False) -> None:
        """Everything ``state`` needs, made ahead (on the grammar thread, before admission):
        the compiled matcher, kept on ``spec``, and with ``budget`` the closing index, so
        that the engine thread never waits for the grammar thread."""
        self.compile(spec)
        if budget:
            self._closing()

    def _build(self, spec: GrammarSpec, grammar: str) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        limits = LLParserLimits(verbose_errors=False)  # errors never echo the grammar
        matcher = LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidParameter(spec.param, _plain(matcher.get_error()), code="invalid_value")
        probe = matcher.deep_copy()
        probe.compute_bitmask()  # finds out whether any token may start
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            # Nothing can start and nothing is complete (`[^\s\S]`, a schema that is only
            # its own $ref): no text satisfies it, not even "".
            raise InvalidParameter(
                spec.param, "the grammar admits no output at all", code="invalid_value"
            )
        # The copies share one lexer, whose expression budget the first mask can leave all
        # but spent (`a{300000}`): then every request's first mask fails. A second copy's
        # mask finds that out here, before admission.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        _check_limits(spec.param, probe)
        return matcher

    def state(
        self, spec: GrammarSpec, stop_ids: Iterable[int], budget: int | None = None
    ) -> GrammarState:
        """A fresh grammar state for one sequence whose stop tokens are ``stop_ids``;
        ``budget``: its ``max_tokens``, to close within (``mtplx.grammar_budget``), or None."""
        matcher = self.compile(spec)
        eos = list(self._ll_tokenizer.eos_tokens)
        index = None if budget is None else self._closing()
        words: tuple[Word, ...] = ()
        if index is not None and spec.kind == "json_schema":
            names = schema_words(json.loads(spec.source))[:_MAX_WORDS]
            words = tuple(Word.of(name, self._ll_tokenizer) for name in names)
        return GrammarState(
            matcher.deep_copy(), self.vocab_size, stop_ids, eos, budget, index, spec.param, words
        )

    def _closing(self) -> ClosingIndex:
        if self._closing_index is None:
            self._closing_index = _on_grammar_thread(
                ClosingIndex.build, self._llguidance_tokenizer(), self.vocab_size
            )
        return self._closing_index


class GrammarState:
    """One sequence's position in its grammar: advanced by committed and draft tokens,
    rolled back past rejected drafts. A stop token ends it (the sequence stops there)."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        grammar_eos: list[int],
        budget: int | None = None,
        closing: ClosingIndex | None = None,
        param: str = "grammar",
        words: tuple[Word, ...] = (),
    ) -> None:
        """``budget``: the output tokens the text must complete within (the budget rule of
        ``mtplx.grammar_budget``, with the tokenizer's ``closing`` index), None for none."""
        self.matcher = matcher
        self.param = param  # the API field the grammar came from, for errors
        self.budget = budget if closing is not None else None
        self.closing = closing
        self.words = words  # the schema's property names, for the closing walk
        self.vocab_size = vocab_size
        self.stop_ids = sorted(t for t in set(stop_ids) if 0 <= t < vocab_size)
        self.grammar_eos = [t for t in grammar_eos if 0 <= t < vocab_size]
        self._fed: list[bool] = []  # per consumed token: did it go to the matcher (not a stop)

    @property
    def ended(self) -> bool:
        """A stop token was consumed."""
        return bool(self._fed) and not self._fed[-1]

    @property
    def finished(self) -> bool:
        """Nothing may follow: a stop token was consumed, or the grammar is complete with no
        continuation. Not a matcher in error (its parser's limits, e.g. the lexer's
        expression budget spent while computing a mask): that text is not complete, and the
        row fails at its next ``consume`` or ``rollback`` instead of ending as if done."""
        return self.ended or (self.matcher.is_stopped() and not self.matcher.is_error())

    def allowed(self) -> np.ndarray | None:
        """[V] bool: the tokens allowed next, or None when nothing is (``finished``, a
        grammar whose next tokens all lie outside the model's vocabulary, or a matcher the
        mask put in error: never raises, as it runs for a whole batch's verify)."""
        if self.finished:
            return None
        bitmask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            return None  # not even a stop token: the text is not complete
        bits = np.unpackbits(bitmask, bitorder="little").view(bool)
        allowed = np.zeros(self.vocab_size, dtype=bool)
        width = min(self.vocab_size, bits.shape[0])
        allowed[:width] = bits[:width]
        # The grammar's own EOS stands for "complete": the sequence's stop tokens take its
        # place (none with ignore_eos), so only they end the text.
        allowed[self.grammar_eos] = False
        if self.stop_ids and self.matcher.is_accepting():
            allowed[self.stop_ids] = True
        if self.budget is not None:
            allowed = self._within_budget(allowed)
        return allowed if allowed.any() else None

    def _within_budget(self, allowed: np.ndarray) -> np.ndarray:
        """The budget rule (``mtplx.grammar_budget``): in the closing stretch, only tokens
        that spell a prefix of the closing (the stop tokens once the text is complete)."""
        assert self.budget is not None and self.closing is not None
        margin = grammar_budget.CLOSING_MARGIN
        left = self.budget - self.num_consumed  # this token included
        closing = closing_text(self.matcher, self.closing, limit=left, words=self.words)
        if closing is None or left > len(closing) + margin:
            return allowed
        keep = np.zeros_like(allowed)
        keep[[t for t in closing_tokens(closing, self.closing) if t < self.vocab_size]] = True
        if not closing:
            keep[self.stop_ids] = True
        narrowed = allowed & keep
        return narrowed if narrowed.any() else allowed

    def consume(self, token: int) -> None:
        """Advance by one token the mask allowed."""
        if self.ended:
            raise ValueError("the grammar state has ended: no token may follow a stop token")
        _check_limits(self.param, self.matcher)
        if token in self.stop_ids:
            self._fed.append(False)
            return
        if not self.matcher.consume_token(int(token)):
            # Masks only offer allowed tokens: what fails here is the parser's own limits.
            raise InvalidParameter(
                self.param,
                f"the grammar failed at token {token}: {_plain(self.matcher.get_error())}",
                code="grammar_too_complex",
            )
        self._fed.append(True)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens."""
        if num_tokens <= 0:
            return
        _check_limits(self.param, self.matcher)
        undone = self._fed[-num_tokens:]
        del self._fed[-num_tokens:]
        fed = sum(undone)
        if fed and not self.matcher.rollback(fed):
            raise ValueError(f"grammar rollback failed: {_plain(self.matcher.get_error())}")

    @property
    def num_consumed(self) -> int:
        """Tokens consumed so far (committed and draft)."""
        return len(self._fed)
