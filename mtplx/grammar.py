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
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mtplx.errors import InvalidParameter

__all__ = ["GrammarCompiler", "GrammarSpec", "GrammarState", "check_grammar"]

GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]
_CACHE_SIZE = 64  # compiled grammars kept per tokenizer (schemas repeat across requests)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``source``: the JSON Schema as canonical
    JSON text, the regex or the Lark grammar; ``param``: the API field to name in errors."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

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
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


_checked: OrderedDict[GrammarSpec, str] = OrderedDict()
_checked_lock = threading.Lock()


def check_grammar(spec: GrammarSpec) -> str:
    """Validate ``spec`` without a tokenizer (cached); its llguidance grammar. Raises
    InvalidParameter naming ``spec.param`` and the problem (an invalid schema, regex or
    grammar)."""
    with _checked_lock:
        if spec in _checked:
            _checked.move_to_end(spec)
            return _checked[spec]
    from llguidance import LLMatcher

    what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex"}
    try:
        grammar = spec.llguidance_grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as exc:
        is_error, messages = True, [str(exc)]
    if is_error:
        problem = messages[0] if messages else "invalid"
        raise InvalidParameter(
            spec.param, f"invalid {what.get(spec.kind, 'grammar')}: {problem}", code="invalid_value"
        )
    with _checked_lock:
        _checked[spec] = grammar
        while len(_checked) > _CACHE_SIZE:
            _checked.popitem(last=False)
    return grammar


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
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the llguidance tokenizer now (server start), not in the first constrained
        request, where it would hold up the whole batch for about a second."""
        with self._lock:
            self._llguidance_tokenizer()

    def _llguidance_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            eos = sorted(getattr(self.tokenizer, "eos_token_ids", None) or []) or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        return self._ll_tokenizer

    def state(self, spec: GrammarSpec, stop_ids: Iterable[int]) -> GrammarState:
        """A fresh grammar state for one sequence whose stop tokens are ``stop_ids``."""
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(spec)
            if matcher is None:
                tokenizer = self._llguidance_tokenizer()
                matcher = LLMatcher(tokenizer, check_grammar(spec), log_level=0)
                if matcher.is_error():
                    raise InvalidParameter(spec.param, matcher.get_error(), code="invalid_value")
                probe = matcher.deep_copy()
                probe.compute_bitmask()  # finds out whether any token may start
                if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
                    # Nothing can start and nothing is complete (`[^\s\S]`, a schema that is
                    # only its own $ref): no text satisfies it, not even "".
                    raise InvalidParameter(
                        spec.param, "the grammar admits no output at all", code="invalid_value"
                    )
                self._compiled[spec] = matcher
                while len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
            eos = list(self._ll_tokenizer.eos_tokens)
            return GrammarState(matcher.deep_copy(), self.vocab_size, stop_ids, eos)


class GrammarState:
    """One sequence's position in its grammar: advanced by committed and draft tokens,
    rolled back past rejected drafts. A stop token ends it (the sequence stops there)."""

    def __init__(
        self, matcher: Any, vocab_size: int, stop_ids: Iterable[int], grammar_eos: list[int]
    ) -> None:
        self.matcher = matcher
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
        continuation (or in error, which masks never let happen)."""
        return self.ended or self.matcher.is_stopped()

    def allowed(self) -> np.ndarray | None:
        """[V] bool: the tokens allowed next, or None when nothing is (``finished``, or a
        grammar whose next tokens all lie outside the model's vocabulary)."""
        if self.finished:
            return None
        bitmask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(bitmask, bitorder="little").view(bool)
        allowed = np.zeros(self.vocab_size, dtype=bool)
        width = min(self.vocab_size, bits.shape[0])
        allowed[:width] = bits[:width]
        # The grammar's own EOS stands for "complete": the sequence's stop tokens take its
        # place (none with ignore_eos), so only they end the text.
        allowed[self.grammar_eos] = False
        if self.stop_ids and self.matcher.is_accepting():
            allowed[self.stop_ids] = True
        return allowed if allowed.any() else None

    def consume(self, token: int) -> None:
        """Advance by one token the mask allowed."""
        if self.ended:
            raise ValueError("the grammar state has ended: no token may follow a stop token")
        if token in self.stop_ids:
            self._fed.append(False)
            return
        if not self.matcher.consume_token(int(token)):
            error = self.matcher.get_error()
            raise ValueError(f"token {token} is not allowed by the grammar: {error}")
        self._fed.append(True)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens."""
        if num_tokens <= 0:
            return
        undone = self._fed[-num_tokens:]
        del self._fed[-num_tokens:]
        fed = sum(undone)
        if fed and not self.matcher.rollback(fed):
            raise ValueError(f"grammar rollback failed: {self.matcher.get_error()}")

    @property
    def num_consumed(self) -> int:
        """Tokens consumed so far (committed and draft)."""
        return len(self._fed)
