"""Reasoning models: telling a reply's thinking (``<think>...</think>``) from its answer.

A ``ReasoningParser`` is chosen once per model (``reasoning_parser``): from the chat
template (``auto``: a template that knows ``</think>``, as Qwen3 / Qwen3.5 / DeepSeek-R1
templates do) or by name, as vLLM names them:

- ``qwen3``: the reply thinks when it opens with ``<think>``, or when the prompt left a
  ``<think>`` open (a template that opens the thinking in its generation prompt: the output
  then starts inside it and only emits ``</think>``).
- ``deepseek_r1``: the reply always starts inside the thinking, unless the prompt closed it
  (its last tag is ``</think>``, as a template's "thinking off" form writes); an opening
  ``<think>`` the model writes anyway is dropped.
- ``none``: no parsing; the thinking stays in the text.

Per reply a ``ReasoningSplitter`` takes the text piece by piece (a tag may be split across
pieces) and answers (reasoning, content) deltas; a whole reply is split by the same
machine, so a stream's deltas always add up to the non-streamed reply. The reasoning is the
text between the tags with its surrounding whitespace stripped; the answer is the text after
``</think>`` with its leading whitespace stripped; a reply that never closes its thinking is
all reasoning. A reply that does not think is content, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PARSER_NAMES",
    "ReasoningParser",
    "ReasoningSplitter",
    "ReplyReasoning",
    "SplitReply",
    "reasoning_parser",
    "template_text",
]

PARSER_NAMES = ("auto", "none", "qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
# Written after ``</think>`` when the server closes a thinking block the prompt opened.
_AFTER_END = "\n\n"


def template_text(tokenizer: Any) -> str:
    """The chat template's source (every named template, joined), "" when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # [{"name", "template"}] as some configs store them
        return "\n".join(t.get("template", "") for t in template if isinstance(t, Mapping))
    return template if isinstance(template, str) else ""


@dataclass(frozen=True)
class ReasoningParser:
    """One model's thinking tags, and how a reply starts."""

    name: str
    close_ids: tuple[int, ...]  # ``</think>`` and the blank line after it, as token ids
    start: str = THINK_START
    end: str = THINK_END

    def opens_in(self, reply_prefix: str) -> bool:
        """Whether a reply starts inside the thinking, judged by ``reply_prefix``: the text
        in front of the reply inside its turn (the template's generation prompt, and an
        assistant prefill). Tags earlier in the prompt (a user quoting them) do not
        count."""
        last_start = reply_prefix.rfind(self.start)
        last_end = reply_prefix.rfind(self.end)
        if self.name == "deepseek_r1":
            return not last_end > last_start  # open unless the prefix's last tag closes
        return last_start > last_end

    def reply(self, reply_prefix: str) -> ReplyReasoning:
        """How a reply after ``reply_prefix`` is split."""
        return ReplyReasoning(self, self.opens_in(reply_prefix))


@dataclass(frozen=True)
class SplitReply:
    """A whole reply, split: ``reasoning`` None when the reply did not think (or thought
    nothing); ``reasoning_pieces`` how many of its pieces were thinking; ``closed`` whether
    the thinking ended (False: the reply was cut, or never thought)."""

    reasoning: str | None
    content: str
    reasoning_pieces: int
    closed: bool


@dataclass(frozen=True)
class ReplyReasoning:
    """How one prompt's replies are split: the parser, and whether the prompt opened the
    thinking."""

    parser: ReasoningParser
    opened: bool

    def splitter(self) -> ReasoningSplitter:
        """A new splitter for one reply (one per choice)."""
        return ReasoningSplitter(self.parser.start, self.parser.end, self.opened)

    def split_tokens(self, token_texts: Sequence[str], text: str) -> SplitReply:
        """A whole reply from its tokens' texts and its whole ``text`` (which ends with the
        tail the detokenizer held back until the finish): ``reasoning_pieces`` counts
        tokens."""
        tail = text[len("".join(token_texts)) :]
        return self.split([*token_texts, tail] if tail else token_texts)

    def split(self, pieces: Iterable[str]) -> SplitReply:
        """A whole reply, given as its pieces (token texts, then the finish tail)."""
        splitter = self.splitter()
        reasoning, content = [], []
        for piece in pieces:
            r, c = splitter.add(piece)
            reasoning.append(r)
            content.append(c)
        r, c = splitter.finish()
        reasoning.append(r)
        content.append(c)
        text = "".join(reasoning)
        closed = splitter.closed
        return SplitReply(text or None, "".join(content), splitter.reasoning_pieces, closed)


# Splitter states.
_START = "start"  # the reply's start: it may still open with <think>
_THINK_LEAD = "think-lead"  # inside the thinking, before its first visible character
_THINK = "think"
_ANSWER_LEAD = "answer-lead"  # after </think>, before the answer's first visible character
_ANSWER = "answer"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits one reply's text, piece by piece, into reasoning and content deltas. Text
    that may still turn out to be a tag (or whitespace that may be trimmed) is held back
    until it is decided; ``finish`` releases it."""

    def __init__(
        self, start: str = THINK_START, end: str = THINK_END, opened: bool = False
    ) -> None:
        self.start = start
        self.end = end
        self.state = _THINK_LEAD if opened else _START
        self.dropped_start = False  # an opening tag was dropped (only one ever is)
        self.held = ""
        self.ended = False  # the thinking closed
        self.reasoning_pieces = 0  # pieces added while inside the thinking

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking now."""
        return self.state in (_THINK_LEAD, _THINK)

    @property
    def closed(self) -> bool:
        """Whether the reply thought and its thinking ended."""
        return self.ended

    def add(self, text: str) -> tuple[str, str]:
        """Feed one piece; the (reasoning, content) that may go out now."""
        if self.thinking:
            self.reasoning_pieces += 1
        return self._run(self.held + text)

    def finish(self) -> tuple[str, str]:
        """At the end of the reply: the text still held back."""
        held, self.held = self.held, ""
        if self.state == _START:
            return "", held  # whitespace, or a start tag never completed: content
        if self.thinking:
            return held.rstrip(), ""  # a tag never completed is reasoning
        return "", held

    def _run(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        self.held = ""
        while text:
            if self.state == _START:
                stripped = text.lstrip()
                if not stripped or (self.start.startswith(stripped) and stripped != self.start):
                    self.held = text  # whitespace or part of <think>: undecided
                    return reasoning, content
                if stripped.startswith(self.start):
                    text = stripped[len(self.start) :]
                    self.dropped_start = True
                    self.state = _THINK_LEAD
                    continue
                self.state = _ANSWER
                content += text
                return reasoning, content
            if self.state == _THINK_LEAD:
                stripped = text.lstrip()
                if not stripped:
                    return reasoning, content  # leading whitespace of the reasoning
                if not self.dropped_start:
                    if self.start.startswith(stripped) and stripped != self.start:
                        self.held = stripped
                        return reasoning, content
                    if stripped.startswith(self.start):
                        self.dropped_start = True
                        text = stripped[len(self.start) :]
                        continue
                self.state = _THINK
                text = stripped
                continue
            if self.state == _THINK:
                at = text.find(self.end)
                if at >= 0:
                    reasoning += text[:at].rstrip()
                    text = text[at + len(self.end) :]
                    self.state = _ANSWER_LEAD
                    self.ended = True
                    continue
                keep = _partial_suffix(text, self.end)
                body = text[: len(text) - keep]
                body_kept = body.rstrip()  # trailing whitespace may precede </think>
                self.held = body[len(body_kept) :] + text[len(text) - keep :]
                reasoning += body_kept
                return reasoning, content
            if self.state == _ANSWER_LEAD:
                text = text.lstrip()
                if text:
                    self.state = _ANSWER
                continue
            content += text  # _ANSWER
            return reasoning, content
        return reasoning, content


def reasoning_parser(
    tokenizer: Any, name: str, encode: Callable[[str], Sequence[int]] | None = None
) -> ReasoningParser | None:
    """The model's parser for ``name`` (one of ``PARSER_NAMES``); None when replies are not
    split (``none``, or ``auto`` with a template that writes no ``</think>``)."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(PARSER_NAMES)}")
    if name == "none":
        return None
    if name == "auto":
        if THINK_END not in template_text(tokenizer):
            return None
        name = "qwen3"
    if encode is None:

        def encode(text: str) -> Sequence[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    close_ids = tuple(int(t) for t in encode(THINK_END + _AFTER_END))
    return ReasoningParser(name=name, close_ids=close_ids)
