"""The drafters an engine offers: a maker per drafter name (each sequence gets its own)."""

from __future__ import annotations

from collections.abc import Callable

from mtplx.drafters.base import Drafter
from mtplx.drafters.draft_model import DraftModelDrafter
from mtplx.drafters.lookup_first import LookupFirstDrafter
from mtplx.drafters.mtp import MTPDrafter
from mtplx.drafters.ngram import NgramDrafter
from mtplx.models.base import LoadedModel, TargetModel


def drafter_factories(
    model: LoadedModel, draft_model: TargetModel | None
) -> dict[str, Callable[[], Drafter | None]]:
    """Drafter name -> a maker of that drafter for one sequence (each has its own state)."""
    factories: dict[str, Callable[[], Drafter | None]] = {
        "none": lambda: None,
        "ngram": NgramDrafter,
    }
    if model.mtp_heads:
        factories["mtp"] = lambda: MTPDrafter(model)
    if draft_model is not None:
        factories["draft_model"] = lambda: DraftModelDrafter(draft_model)
    for name in ("mtp", "draft_model"):
        if name in factories:
            make_model_drafter = factories[name]
            factories[f"{name}+ngram"] = lambda make=make_model_drafter: LookupFirstDrafter(
                NgramDrafter(),
                make(),  # type: ignore[arg-type]
            )
    return factories
