"""Turning committed tokens into text: streaming detokenization and stop strings.

Text is released piece by piece as tokens commit. A stop string may straddle token
boundaries, so the tail of the text that could still grow into a stop string is held back
until it either completes one (the text before it is released, the stop string never is) or
can no longer match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextEmitter:
    """Streaming text of one sequence with stop-string handling."""

    def __init__(
        self, detokenizer: Any, stop: Sequence[str] = (), primer: int | None = None
    ) -> None:
        """detokenizer: an mlx-lm StreamingDetokenizer (reset / add_token / last_segment /
        finalize); it never splits a UTF-8 character across segments. mlx-lm's detokenizers
        drop the leading space of the first token (right when the text starts a reply of
        its own). ``primer``: a token fed first and its text dropped, so that the text
        continues a prompt instead, keeping that space: the concatenation of its tokens'
        text."""
        self.detokenizer = detokenizer
        self.detokenizer.reset()
        if primer is not None:
            self.detokenizer.add_token(primer)
            _ = self.detokenizer.last_segment
        self.stop = tuple(stop)
        self.held = ""  # released by the detokenizer, not yet by us
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic asks)

    def add(self, token_id: int) -> str:
        """Feed one committed token; returns the text released with it. After a stop string
        completes, ``stopped`` is True and the text before the stop string is returned."""
        self.detokenizer.add_token(token_id)
        return self._release(self.detokenizer.last_segment)

    def flush(self) -> str:
        """The text still held back when the sequence ends without a stop string."""
        if self.stopped:
            return ""
        self.detokenizer.finalize()
        text = self.held + self.detokenizer.last_segment
        self.held = ""
        return text

    def _release(self, segment: str) -> str:
        text = self.held + segment
        if not self.stop:
            self.held = ""
            return text
        found = [(i, n, s) for n, s in enumerate(self.stop) if (i := text.find(s)) >= 0]
        if found:
            # The earliest match ends the text; at one position the first listed stop wins.
            first, _, self.matched = min(found)
            self.stopped = True
            self.held = ""
            return text[:first]
        keep = _longest_stop_prefix_suffix(text, self.stop)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
