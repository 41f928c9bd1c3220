"""The drafters an engine offers: a maker per drafter name (each sequence gets its own),
built from the one list of names in ``mtplx.drafter_registry``."""

from __future__ import annotations

from collections.abc import Callable

from mtplx.drafter_registry import DrafterKind, available_drafters, drafter_kind
from mtplx.drafters.base import Drafter
from mtplx.drafters.draft_model import DraftModelDrafter
from mtplx.drafters.lookup_first import LookupFirstDrafter
from mtplx.drafters.mtp import MTPDrafter
from mtplx.drafters.ngram import NgramDrafter
from mtplx.models.base import LoadedModel, TargetModel


def drafter_factories(
    model: LoadedModel, draft_model: TargetModel | None
) -> dict[str, Callable[[], Drafter | None]]:
    """Drafter name -> a maker of that drafter for one sequence (each has its own state),
    for every registered drafter this model can run (``available_drafters``' order)."""
    sources: dict[str, Callable[[], Drafter | None]] = {
        "none": lambda: None,
        "ngram": NgramDrafter,
    }
    if model.mtp_heads:
        sources["mtp"] = lambda: MTPDrafter(model)
    if draft_model is not None:
        sources["draft_model"] = lambda: DraftModelDrafter(draft_model)
    names = available_drafters("mtp" in sources, "draft_model" in sources)
    return {name: _maker(drafter_kind(name), sources[drafter_kind(name).source]) for name in names}


def _maker(
    kind: DrafterKind, make_source: Callable[[], Drafter | None]
) -> Callable[[], Drafter | None]:
    """The maker of one drafter: its source's, or a lookup-first mix of n-gram lookup and it."""
    if not kind.lookup_first:
        return make_source

    def make() -> Drafter | None:
        fallback = make_source()
        assert fallback is not None, "a lookup-first drafter mixes n-gram lookup with a model"
        return LookupFirstDrafter(NgramDrafter(), fallback)

    return make
