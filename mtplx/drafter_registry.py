"""The one list of drafter names: what each needs from the loaded model, and which the
engine prefers when none is named.

MLX-free, so the HTTP layer can validate names without loading MLX. The drafter objects
themselves are built by ``mtplx.drafters.factories`` from this list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DRAFTERS",
    "DRAFTER_NAMES",
    "DrafterKind",
    "available_drafters",
    "best_drafter",
    "drafter_kind",
]

Source = Literal["none", "ngram", "mtp", "draft_model"]


@dataclass(frozen=True)
class DrafterKind:
    """One drafter name. ``source``: the model drafter it runs (``mtp``: the checkpoint's MTP
    heads, ``draft_model``: a draft model), or ``ngram`` / ``none`` when it needs no model;
    ``lookup_first``: n-gram lookup drafts when the history has a match, else ``source``;
    ``preference``: rank as the engine's default when no drafter is named (lower wins; None:
    never chosen by default)."""

    name: str
    source: Source
    lookup_first: bool = False
    preference: int | None = None

    @property
    def needs(self) -> str | None:
        """Why this drafter may be unavailable (for messages), or None when it always is."""
        return {
            "mtp": "the checkpoint has no MTP heads",
            "draft_model": "no draft model was given (--draft-layers N)",
        }.get(self.source)


DRAFTERS: tuple[DrafterKind, ...] = (
    DrafterKind("mtp+ngram", "mtp", lookup_first=True, preference=0),
    DrafterKind("draft_model+ngram", "draft_model", lookup_first=True, preference=1),
    DrafterKind("mtp", "mtp"),
    DrafterKind("draft_model", "draft_model"),
    DrafterKind("ngram", "ngram", preference=2),
    DrafterKind("none", "none"),
)
DRAFTER_NAMES: tuple[str, ...] = tuple(kind.name for kind in DRAFTERS)
_BY_NAME = {kind.name: kind for kind in DRAFTERS}


def drafter_kind(name: str) -> DrafterKind:
    """The registry entry of ``name`` (KeyError for an unknown name)."""
    return _BY_NAME[name]


_SOURCES: tuple[Source, ...] = ("none", "ngram", "mtp", "draft_model")


def available_drafters(has_mtp: bool, has_draft_model: bool) -> tuple[str, ...]:
    """The drafter names a model with (or without) MTP heads and a draft model can run:
    single sources first (none, ngram, mtp, draft_model), then the lookup-first mixes."""
    present = {"none": True, "ngram": True, "mtp": has_mtp, "draft_model": has_draft_model}
    kinds = sorted(
        (kind for kind in DRAFTERS if present[kind.source]),
        key=lambda kind: (kind.lookup_first, _SOURCES.index(kind.source)),
    )
    return tuple(kind.name for kind in kinds)


def best_drafter(available: tuple[str, ...] | list[str]) -> str:
    """The preferred drafter among ``available`` (the engine's default)."""
    ranked = [k for k in DRAFTERS if k.preference is not None and k.name in available]
    return min(ranked, key=lambda kind: kind.preference or 0).name
