"""Constrained output that closes within its token budget.

A grammar says what text may come, not how long it takes: a small model sampling a JSON
object can keep adding keys until ``max_tokens`` cuts it, and the reply does not parse. The
budget rule makes the constraint know the budget. At a grammar state s:

- the *closing* C(s) is the text a fixed greedy walk writes from s to a complete parse, one
  character at a time: at each step the first allowed of ``"``, ``}``, ``]``, ``0``, ``:``,
  else the allowed one-character token of lowest id (what a schema forces: a required key's
  next letter). ``|C(s)|`` bounds how many tokens completing s takes.
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

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CLOSING_MARGIN", "ClosingIndex", "closing_text", "closing_tokens"]

# Tokens of slack kept before the closing stretch (for a token that opens structure); at
# least 1, the token that may complete the text.
CLOSING_MARGIN = 8
_PREFERRED = ('"', "}", "]", "0", ":")


@dataclass(frozen=True)
class ClosingIndex:
    """What the closing walk needs of a tokenizer: its one-character tokens (the preferred
    ones first) and every token's bytes by text, to find the tokens spelling a prefix."""

    preferred: tuple[int, ...]  # token ids of _PREFERRED that are single tokens, in order
    single: np.ndarray  # [K] int: one-character tokens, ascending id
    token_bytes: dict[int, bytes]  # id -> bytes, for the one-character tokens
    by_bytes: dict[bytes, tuple[int, ...]]  # bytes -> the tokens spelling them
    max_token_bytes: int

    @classmethod
    def build(cls, ll_tokenizer: Any, vocab_size: int) -> ClosingIndex:
        """From an llguidance tokenizer (about a second for a 49k vocabulary; once)."""
        by_bytes: dict[bytes, list[int]] = {}
        special = set(ll_tokenizer.eos_tokens)
        for token in range(min(vocab_size, ll_tokenizer.vocab_size)):
            if token in special or ll_tokenizer.is_special_token(token):
                continue
            text = ll_tokenizer.decode_bytes([token])
            if text:
                by_bytes.setdefault(text, []).append(token)
        # Every one-byte token, the bytes past ASCII included: a closing may first have to
        # finish a UTF-8 character the text stopped inside.
        single = sorted(tokens[0] for text, tokens in by_bytes.items() if len(text) == 1)
        token_bytes = {token: ll_tokenizer.decode_bytes([token]) for token in single}
        first = {text: tokens[0] for text, tokens in by_bytes.items()}
        preferred = tuple(first[c.encode()] for c in _PREFERRED if c.encode() in first)
        return cls(
            preferred,
            np.array(single, dtype=np.int64),
            token_bytes,
            {text: tuple(tokens) for text, tokens in by_bytes.items()},
            max((len(text) for text in by_bytes), default=1),
        )


def closing_text(matcher: Any, index: ClosingIndex, limit: int) -> bytes | None:
    """C(s) of the matcher's state (left as it was), None when the walk finds none within
    ``limit`` characters (a grammar whose preferred characters loop: the rule then leaves
    the state unrestricted)."""
    closing = bytearray()
    steps = 0
    try:
        while not matcher.is_accepting() and steps < limit:
            token = next((t for t in index.preferred if matcher.try_consume_tokens([t])), None)
            if token is None:
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )
                allowed = index.single[index.single < bits.shape[0]]
                allowed = allowed[bits[allowed].astype(bool)]
                if allowed.size == 0 or not matcher.consume_token(int(allowed[0])):
                    return None
                token = int(allowed[0])
            closing += index.token_bytes[token]
            steps += 1
        return bytes(closing) if matcher.is_accepting() else None
    finally:
        if steps:
            matcher.rollback(steps)


def closing_tokens(closing: bytes, index: ClosingIndex) -> list[int]:
    """The tokens that spell a non-empty prefix of ``closing``."""
    tokens: list[int] = []
    for end in range(1, min(len(closing), index.max_token_bytes) + 1):
        tokens.extend(index.by_bytes.get(closing[:end], ()))
    return tokens
