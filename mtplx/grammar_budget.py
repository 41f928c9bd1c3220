"""Constrained output that closes within its token budget.

A grammar says what text may come, not how long it takes: a small model sampling a JSON
object can keep adding keys until ``max_tokens`` cuts it, and the reply does not parse. The
budget rule makes the constraint know the budget. At a grammar state s:

- the *closing* C(s) is the text a fixed greedy walk writes from s to a complete parse, one
  character at a time: at each step the first allowed of ``"``, ``}``, ``]``, ``0``, ``:``,
  else the shortest allowed token, lowest id first (what a schema forces: a required key's
  next letter). Where a key starts it first tries the schema's property names (required
  ones first, each once), since a schema that admits other keys would let the walk add
  empty keys forever. ``|C(s)|`` bounds how many tokens completing s takes.
- while more than ``|C(s)| + CLOSING_MARGIN`` tokens are left (this one included), the
  rule admits every token the grammar does; once no more are left, it admits only tokens
  that spell a prefix of C(s) (and the stop tokens when s is complete). Each such token
  shortens the closing by its length (the walk from s·t is the rest of the walk from s), so
  the text completes within the budget.

The rule is a function of the grammar state and the tokens left, nothing else: it is part of
the constrained target distribution, which speculation then reproduces exactly (drafts are
masked by the same rule at their positions). A token that opens more than
``CLOSING_MARGIN`` characters of structure just before the closing stretch can still leave
too little room; the text is then cut as without the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CLOSING_MARGIN",
    "ClosingIndex",
    "Word",
    "closing_text",
    "closing_tokens",
    "schema_words",
]

# Tokens of slack kept before the closing stretch (for a token that opens structure); at
# least 1, the token that may complete the text.
CLOSING_MARGIN = 8
_PREFERRED = ('"', "}", "]", "0", ":")


@dataclass(frozen=True)
class Word:
    """A property name and its closing quote, as tokens and as text."""

    tokens: tuple[int, ...]
    text: bytes

    @classmethod
    def of(cls, name: str, ll_tokenizer: Any) -> Word:
        """``name"`` tokenized by an llguidance tokenizer."""
        text = (name + '"').encode()
        return cls(tuple(ll_tokenizer.tokenize_bytes(text)), text)


@dataclass(frozen=True)
class ClosingIndex:
    """What the closing walk needs of a tokenizer: the preferred characters' tokens, every
    token's length and bytes, and the tokens by their bytes (those spelling a prefix)."""

    preferred: tuple[int, ...]  # token ids of _PREFERRED that are single tokens, in order
    lengths: np.ndarray  # [V] int: each token's length in bytes (0: special, never walked)
    by_bytes: dict[bytes, tuple[int, ...]]  # bytes -> the tokens spelling them
    text: dict[int, bytes]  # id -> bytes
    max_token_bytes: int

    def text_of(self, token: int) -> bytes:
        """The token's bytes."""
        return self.text[token]

    @classmethod
    def build(cls, ll_tokenizer: Any, vocab_size: int) -> ClosingIndex:
        """From an llguidance tokenizer (about a second for a 49k vocabulary; once)."""
        by_bytes: dict[bytes, list[int]] = {}
        text_of: dict[int, bytes] = {}
        lengths = np.zeros(vocab_size, dtype=np.int64)
        special = set(ll_tokenizer.eos_tokens)
        for token in range(min(vocab_size, ll_tokenizer.vocab_size)):
            if token in special or ll_tokenizer.is_special_token(token):
                continue
            text = ll_tokenizer.decode_bytes([token])
            if text:
                by_bytes.setdefault(text, []).append(token)
                text_of[token] = text
                lengths[token] = len(text)
        first = {text: tokens[0] for text, tokens in by_bytes.items()}
        preferred = tuple(first[c.encode()] for c in _PREFERRED if c.encode() in first)
        return cls(
            preferred,
            lengths,
            {text: tuple(tokens) for text, tokens in by_bytes.items()},
            text_of,
            max((len(text) for text in by_bytes), default=1),
        )


def schema_words(schema: Any) -> list[str]:
    """The property names of a JSON schema, every level, required ones first (the closing
    walk's words)."""
    required: list[str] = []
    other: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            names = node.get("properties")
            if isinstance(names, dict):
                needed = node.get("required")
                if not isinstance(needed, list):
                    needed = []
                required += [n for n in needed if isinstance(n, str)]
                other += [n for n in names if isinstance(n, str)]
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return list(dict.fromkeys(required + other))


def closing_text(
    matcher: Any, index: ClosingIndex, limit: int, words: Sequence[Word] = ()
) -> bytes | None:
    """C(s) of the matcher's state (left as it was), None when the walk finds none within
    ``limit`` tokens (a grammar whose preferred characters loop: the rule then leaves the
    state unrestricted). ``words``: property names with their closing quote, each tried
    once where a key starts."""
    closing = bytearray()
    steps = 0
    used: set[Word] = set()
    try:
        while not matcher.is_accepting() and steps < limit:
            if closing.endswith((b'{"', b',"')):  # a key starts: a property name first
                word = _take_word(matcher, [w for w in words if w not in used])
                if word is not None:
                    used.add(word)
                    closing += word.text
                    steps += len(word.tokens)
                    continue
            token = next((t for t in index.preferred if matcher.try_consume_tokens([t])), None)
            if token is None:
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )
                width = min(bits.shape[0], index.lengths.shape[0])
                allowed = np.flatnonzero(bits[:width])
                allowed = allowed[index.lengths[allowed] > 0]
                if allowed.size == 0:
                    return None
                # The shortest allowed token, the lowest id among them (argmin's first).
                token = int(allowed[np.argmin(index.lengths[allowed])])
                if not matcher.consume_token(token):
                    return None
            closing += index.text_of(token)
            steps += 1
        return bytes(closing) if matcher.is_accepting() else None
    finally:
        if steps:
            matcher.rollback(steps)


def _take_word(matcher: Any, words: Sequence[Word]) -> Word | None:
    """Consume the first word the matcher takes whole; None (and nothing consumed) if none."""
    for word in words:
        taken = matcher.try_consume_tokens(list(word.tokens))
        if taken == len(word.tokens):
            return word
        if taken:
            matcher.rollback(taken)
    return None


def closing_tokens(closing: bytes, index: ClosingIndex) -> list[int]:
    """The tokens that spell a non-empty prefix of ``closing``."""
    tokens: list[int] = []
    for end in range(1, min(len(closing), index.max_token_bytes) + 1):
        tokens.extend(index.by_bytes.get(closing[:end], ()))
    return tokens
