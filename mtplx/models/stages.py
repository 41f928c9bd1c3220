"""Pipeline stages of a trunk: which contiguous decoder layers each rank keeps.

Part of loading (``mtplx.models.load(..., stage=...)`` drops the other layers before their
weights are read); ``mtplx.distributed`` runs the stages.
"""

from __future__ import annotations

from typing import Any

__all__ = ["keep_stage", "stage_layers"]


def stage_layers(num_layers: int, num_ranks: int) -> list[range]:
    """Contiguous layer ranges, one per rank, as even as possible; the remainder goes to
    the last ranks (rank 0 also runs the embedding, LM head, sampling and drafting)."""
    if num_ranks < 1 or num_layers < num_ranks:
        raise ValueError(f"cannot split {num_layers} layers over {num_ranks} ranks")
    base, extra = divmod(num_layers, num_ranks)
    sizes = [base + (rank >= num_ranks - extra) for rank in range(num_ranks)]
    starts = [sum(sizes[:rank]) for rank in range(num_ranks)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def keep_stage(trunk: Any, rank: int, num_ranks: int) -> range:
    """Drop every decoder layer of ``trunk`` (a ``mtplx.models.target.Trunk``) outside this
    rank's stage, before its weights are evaluated (a lazily loaded model never reads
    them). Returns the stage's layer range."""
    layers = list(trunk.inner.layers)
    kept = stage_layers(len(layers), num_ranks)[rank]
    trunk.inner.layers = layers[kept.start : kept.stop]
    return kept
