"""mtplx.drafter_registry: the one list of drafter names, what each needs, the default."""

from __future__ import annotations

import pytest

from mtplx.drafter_registry import (
    DRAFTER_NAMES,
    DRAFTERS,
    available_drafters,
    best_drafter,
    drafter_kind,
)
from mtplx.request import GenerationRequest


def test_names_are_unique_and_lookup_first_mixes_name_their_source():
    assert len(set(DRAFTER_NAMES)) == len(DRAFTER_NAMES)
    for kind in DRAFTERS:
        assert kind.name == (f"{kind.source}+ngram" if kind.lookup_first else kind.source)


def test_what_a_model_can_run():
    assert available_drafters(False, False) == ("none", "ngram")
    assert available_drafters(True, False) == ("none", "ngram", "mtp", "mtp+ngram")
    assert available_drafters(True, True) == (
        "none",
        "ngram",
        "mtp",
        "draft_model",
        "mtp+ngram",
        "draft_model+ngram",
    )


@pytest.mark.parametrize(
    ("has_mtp", "has_draft_model", "best"),
    [
        (True, True, "mtp+ngram"),
        (True, False, "mtp+ngram"),
        (False, True, "draft_model+ngram"),
        (False, False, "ngram"),
    ],
)
def test_the_default_is_the_best_available(has_mtp, has_draft_model, best):
    assert best_drafter(available_drafters(has_mtp, has_draft_model)) == best


def test_what_an_unavailable_drafter_needs():
    assert drafter_kind("mtp+ngram").needs == "the checkpoint has no MTP heads"
    assert "--draft-layers" in (drafter_kind("draft_model").needs or "")
    assert drafter_kind("ngram").needs is None


def test_requests_accept_exactly_the_registered_names():
    for name in DRAFTER_NAMES:
        GenerationRequest([1], drafter=name)
    with pytest.raises(ValueError, match="drafter must be one of"):
        GenerationRequest([1], drafter="medusa")
