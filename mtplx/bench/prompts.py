"""Benchmark prompts: one JSONL file (or plain text file, one prompt a line) per category
in ``benchmarks/prompts/``; the category is the file's stem."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# benchmarks/ sits next to the mtplx package in a source checkout.
DEFAULT_PROMPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
CATEGORIES = ("chat", "code", "summarize", "repeat")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its category, a stable id and the user message."""

    category: str
    prompt_id: str
    text: str


def load_prompts(
    directory: Path = DEFAULT_PROMPT_DIR,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
    """Prompts of ``categories`` (all files in ``directory`` when None), the first
    ``per_category`` of each. Raises ValueError for a category with no file."""
    files = {p.stem: p for p in sorted(directory.glob("*.jsonl")) + sorted(directory.glob("*.txt"))}
    wanted = list(categories) if categories else sorted(files, key=_category_order)
    prompts: list[Prompt] = []
    for category in wanted:
        if category not in files:
            raise ValueError(f"no prompt file for category {category!r} in {directory}")
        loaded = _read(files[category], category)
        prompts.extend(loaded[:per_category] if per_category else loaded)
    return prompts


def _category_order(name: str) -> tuple[int, str]:
    """Known categories first, in their documented order; others alphabetically after."""
    return (CATEGORIES.index(name) if name in CATEGORIES else len(CATEGORIES), name)


def _read(path: Path, category: str) -> list[Prompt]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".txt":
        return [Prompt(category, f"{category}-{i + 1}", line) for i, line in enumerate(lines)]
    prompts = []
    for i, line in enumerate(lines):
        item = json.loads(line)
        prompts.append(Prompt(category, str(item.get("id", f"{category}-{i + 1}")), item["prompt"]))
    return prompts


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn under the tokenizer's chat template; the raw
    encoding when it has none (a plain completion model)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]
