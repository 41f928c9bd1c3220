"""Drafters: the model's MTP heads, a draft model (or layer-skip self-draft), n-gram lookup,
and lookup-first mixes of a model drafter with n-gram lookup."""

from mtplx.drafters.base import Drafter, DraftSampler
from mtplx.drafters.draft_model import DraftModelDrafter
from mtplx.drafters.lookup_first import LookupFirstDrafter
from mtplx.drafters.mtp import MTPDrafter
from mtplx.drafters.ngram import NgramDrafter, find_continuation

__all__ = [
    "DraftModelDrafter",
    "DraftSampler",
    "Drafter",
    "LookupFirstDrafter",
    "MTPDrafter",
    "NgramDrafter",
    "find_continuation",
]
