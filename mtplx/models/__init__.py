"""Checkpoint loading, MTP heads per family, and compatibility tiers.

Public API::

    load(model, *, dequantize=None, mtp_weights=None) -> LoadedModel
    make_layer_skip_draft(loaded, num_layers) -> TargetModel
    check_same_vocabulary(target, draft) -> None  (ValueError on mismatch)
    inspect(model) -> InspectReport

See ``mtplx.models.base`` for the LoadedModel / TargetModel / MTPHead contract and
``mtplx.models.target`` for the hidden-state convention.
"""

from mtplx.models.base import LoadedModel, MTPHead, TargetModel
from mtplx.models.checkpoint import CheckpointError
from mtplx.models.compat import check_same_vocabulary
from mtplx.models.families import EXIT_CODES, EXIT_ERROR, Tier
from mtplx.models.loader import load
from mtplx.models.report import InspectReport, inspect
from mtplx.models.target import make_layer_skip_draft
from mtplx.models.weights import MTPWeightError

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "CheckpointError",
    "InspectReport",
    "LoadedModel",
    "MTPHead",
    "MTPWeightError",
    "TargetModel",
    "Tier",
    "check_same_vocabulary",
    "inspect",
    "load",
    "make_layer_skip_draft",
]
