"""Check one grammar in a process of its own: ``python grammar_check.py`` reads
``{"kind", "source"}`` as JSON on stdin and writes ``{"grammar", "error"}``.

``mtplx.grammar`` runs it for grammars too large to trust in the server's process: some
compile in time that grows as a power of their size (a schema of a few thousand pattern
properties takes hours), and nothing interrupts llguidance inside a thread; a process can
be killed. It imports llguidance alone (not the mtplx package), so it starts in a fraction
of a second.
"""

from __future__ import annotations

import json
import sys
import threading


def llguidance_grammar(kind: str, source: str) -> str:
    """The grammar of a spec (``mtplx.grammar.GrammarSpec``) in llguidance's form."""
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(source)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    return LLMatcher.grammar_from_lark(source)


def check(kind: str, source: str) -> tuple[str, str | None]:
    """(the llguidance grammar, the first error or None)."""
    from llguidance import LLMatcher, LLParserLimits

    try:
        grammar = llguidance_grammar(kind, source)
        limits = LLParserLimits(verbose_errors=False)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=limits)
    except (ValueError, TypeError) as exc:
        return "", str(exc)
    return grammar, (messages[0] if messages else "invalid") if is_error else None


# As on the server's grammar thread: llguidance's recursive descent needs a deep stack.
STACK_BYTES = 1 << 30


def main() -> None:
    request = json.load(sys.stdin)
    result: dict[str, str | None] = {}

    def run() -> None:
        result["grammar"], result["error"] = check(request["kind"], request["source"])

    threading.stack_size(STACK_BYTES)
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
