"""What one cycle of a row carries between the steps of ``mtplx.speculative``: a proposal
(``Draft``), a plain forward queued one step ahead (``Ahead``), a drafting cycle whose
verdict is still computing (``QueuedDraft``), and what a cycle committed (``CycleResult``).

Plain data only, so ``mtplx.sequence`` can hold them without importing the cycle's logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mtplx.models.rows import RowOutput

__all__ = ["Ahead", "CycleResult", "Draft", "QueuedDraft"]


@dataclass
class CycleResult:
    """What one cycle of a row committed."""

    committed: list[int]  # accepted draft tokens, then the recovered / bonus / sampled token
    num_drafted: int
    num_accepted: int
    target_logits: mx.array  # [n, V] raw target logits at the committed tokens' positions
    draft_time: float
    verify_time: float


@dataclass
class Ahead:
    """The target forward of a row's newest token, queued: its cache entry is written and its
    outputs are being computed."""

    logits: mx.array  # [1, V]
    hidden: mx.array  # [1, H]
    sample: mx.array  # [1] int32, the plain-decoding draw of the next token from these logits


@dataclass
class Draft:
    """One row's proposal for this step and what its verification needs."""

    tokens: mx.array  # [k] int32 draft tokens (k may be below the planned depth)
    qs: list[mx.array]  # k x [V] proposal distributions
    uniforms: mx.array  # [2 * planned + 1], see cycle_uniforms
    num_planned: int
    draft_time: float
    checkpoint: object = None  # the row's state before the forward (recurrent targets)
    masks: list[mx.array] = field(default_factory=list)  # k x [V] bool grammar masks

    @property
    def num_drafted(self) -> int:
        return int(self.tokens.shape[0])

    def inputs(self, last_token: int | mx.array) -> mx.array:
        """[k + 1] int32: the row's tokens for the forward (``last_token``: an id, or [1]
        int32 lazy)."""
        if isinstance(last_token, int):
            last_token = mx.array([last_token], mx.int32)
        return mx.concatenate([last_token, self.tokens])


@dataclass
class QueuedDraft:
    """A drafting cycle whose verdict is still computing (see the module docstring)."""

    draft: Draft
    output: RowOutput
    num_accepted: mx.array  # [1] int32
    output_tokens: mx.array  # [1, k+1] int32
    source: str | None  # the depth policy that planned it
    started: float  # when its step began
    # [] int32: the drafts it rejects, the row's lazy trim (evaluated with the verdict, so
    # that reading it does not wait for the cycle queued after it)
    num_rejected: mx.array
    # [1] int32: its last committed token, lazy (the next cycle's first input); None: taken
    # from output_tokens when the next cycle is built
    last: mx.array | None = None
