"""``SlotTarget``: the batched target of llama-like trunks (the default model), every row a
slot of a KV store and all rows' tokens packed into one ``[1, N]`` sequence for every matmul,
so each weight is read once per step for all rows (see ``mtplx.models.batched`` for why a
row's logits never depend on the other rows, bitwise).

The target is assembled from one class per concept: ``SlotStores`` (rows, KV memory, saved
blocks: ``mtplx.models.slot_store``) and ``SlotLayers`` (the layer plans:
``mtplx.models.slot_layers``); the rows' layout in a forward is ``mtplx.models.slot_layout``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mtplx.blas_shim import INVARIANT_MAX_ROWS
from mtplx.models.compiled_layer import CompiledLayer
from mtplx.models.fused_projections import fuse_projections
from mtplx.models.kv_store import SHARED_CAPACITY
from mtplx.models.rows import RowOutput, logits_per_row
from mtplx.models.slot_layers import SlotLayers
from mtplx.models.slot_layout import (
    VERIFY_TOKENS,
    SlotGroup,
    SlotRow,
    build_group,
    shifted_positions,
)
from mtplx.models.slot_store import SlotStores

__all__ = ["UNBOUNDED_PREFILL_TOKENS", "SlotTarget"]

# A forward's packed tokens when every product runs on the quantized kernel and attention on
# the fused kernel: neither has a row limit (their per-element order does not depend on the
# row count), so a prompt alone feeds this many tokens a forward. The bound keeps a forward's
# scratch arrays small and the shared store's padding (``SlotStores._place``) short.
UNBOUNDED_PREFILL_TOKENS = 384


class SlotTarget(SlotStores, SlotLayers):
    """A llama-like MLXTarget batched over slots (see the module docstring).

    ``attention``: ``"kernel"`` runs every forward's attention (decode, verify and prefill
    alike) in the fused C kernel (``mtplx.attention``), ``"mlx"`` in MLX ops; None picks the
    kernel wherever it serves (CPU, float32 store), unless ``MTPLX_ATTENTION=mlx``. One
    target uses one of them for all its forwards, so its rows stay bitwise consistent."""

    recurrent = False
    max_packed_rows = INVARIANT_MAX_ROWS

    def __init__(
        self,
        target: Any,
        max_rows: int = 16,
        keep_hidden: bool = False,
        attention: str | None = None,
    ) -> None:
        self.target = target
        self.keep_hidden = keep_hidden  # store every position's hidden state (prefix cache)
        self.trunk = target.trunk
        self.vocab_size = target.vocab_size
        self.hidden_size = target.hidden_size
        self.max_rows = max_rows
        self._free = list(range(max_rows))
        self._live: dict[int, SlotRow] = {}  # slot -> its row
        # Rows longer than this keep their KV in a store of their own (``mtplx.models.kv_store``).
        self.shared_capacity = SHARED_CAPACITY
        # The slots in use (grown with the highest one), up to shared_capacity long.
        self._shared = self._new_store(self._initial_slots())
        self._private = {}  # slot -> the store of a row past it
        # An attention product has (heads / kv heads) x (queries) rows: queries go in blocks
        # that keep it within the invariant kernel, like every matmul of a forward of at
        # most INVARIANT_MAX_ROWS tokens, so a prompt's cache is the same bits however it
        # is chunked and whatever shares its forwards.
        first = self.trunk.inner.layers[0].self_attn
        repeats = first.n_heads // first.n_kv_heads
        self._query_block = max(INVARIANT_MAX_ROWS // repeats, 1)
        self._prefill_tokens = INVARIANT_MAX_ROWS
        self._fused = [fuse_projections(layer) for layer in self.trunk.inner.layers]
        self._compiled = CompiledLayer.for_trunk(list(self.trunk.inner.layers), self._fused)
        self.attention = self._attention_kind(attention)
        # Quantized layers on the CPU: fused kernels (mtplx.fused_layer: the compiled pieces'
        # bits in one graph node a layer instead of ~50). False runs the compiled pieces, e.g.
        # to compare the two.
        self.fuses_layers = self._fuses_layers()
        # MTPLX_LAYER_NODE=0: five nodes a layer (its halves, KV writes, attention), same bits.
        self.layer_node = os.environ.get("MTPLX_LAYER_NODE", "1").strip().lower() not in (
            "0",
            "off",
            "no",
        )
        if self.attention == "kernel" and self._products_unbounded():
            # No product of a forward goes through the row-limited BLAS kernel: a prompt
            # alone may feed hundreds of tokens a forward (``Schedule._prefill_piece``).
            self._prefill_tokens = UNBOUNDED_PREFILL_TOKENS
            self.max_packed_rows = UNBOUNDED_PREFILL_TOKENS

    # -- forward ------------------------------------------------------------------------

    def forward(
        self, rows: list[SlotRow], tokens: list[mx.array], logits: Sequence[str] | str = "all"
    ) -> list[RowOutput]:
        """One forward over all rows (see the module docstring). Rows that feed more tokens
        than a verify (prefill chunks) attend in a group of their own, after the others."""
        counts = [int(t.shape[0]) for t in tokens]
        wanted = logits_per_row(logits, rows)
        for row, count in zip(rows, counts, strict=True):
            self._place(row, row.length + count)
        # Shared rows first (verify rows, then prompt chunks), then each long row alone.
        order = sorted(range(len(rows)), key=lambda i: (rows[i].private, counts[i] > VERIFY_TOKENS))
        rows, tokens = [rows[i] for i in order], [tokens[i] for i in order]
        counts, wanted = [counts[i] for i in order], [wanted[i] for i in order]
        groups = self._groups(rows, counts)
        inner = self.trunk.inner
        packed = mx.concatenate(tokens) if len(tokens) > 1 else tokens[0]
        positions = shifted_positions(rows, counts)
        x = self._trunk_layers(inner.embed_tokens(packed[None]), rows, counts, groups, positions)
        hidden = inner.norm(x)[0]  # [N, H]
        self._keep_hidden(rows, counts, hidden)
        for row, count in zip(rows, counts, strict=True):
            row.length += count
        ends = list(itertools.accumulate(counts))
        # The LM head runs on the positions asked for only (a prefill chunk needs none).
        picked = [
            position
            for end, count, want in zip(ends, counts, wanted, strict=True)
            for position in {"all": range(end - count, end), "last": [end - 1], "none": []}[want]
        ]
        head = None
        if picked:
            head = self.trunk.lm_head(hidden[mx.array(picked, mx.int32)][None])[0]  # [P, V]
        outputs, used = [], 0
        for end, count, want in zip(ends, counts, wanted, strict=True):
            size = {"all": count, "last": 1, "none": 0}[want]
            row_logits = None if size == 0 or head is None else head[used : used + size]
            used += size
            outputs.append(RowOutput(row_logits, hidden[end - count : end]))
        unsorted: list[RowOutput] = [outputs[0]] * len(outputs)
        for position, index in enumerate(order):
            unsorted[index] = outputs[position]
        return unsorted

    def _trunk_layers(
        self,
        x: mx.array,
        rows: list[SlotRow],
        counts: list[int],
        groups: list[SlotGroup],
        positions: mx.array,
    ) -> mx.array:
        """The trunk's decoder layers over the packed tokens: x [1, N, H] embedded ->
        [1, N, H] before the final norm. (A pipeline stage runs its own range of layers
        here and exchanges x with the other ranks: ``mtplx.distributed``.)"""
        return self._layers(x, groups, positions)

    def _groups(self, rows: list[SlotRow], counts: list[int]) -> list[SlotGroup]:
        """Consecutive shared rows of one kind in a group: verify rows (at most
        VERIFY_TOKENS tokens), prefill rows (padding a verify row to a prefill chunk's length
        would waste work; both are exact); each long row in a group of its own."""
        slots = [row.slot for row in rows]
        if len(set(slots)) != len(slots) or min(slots) < 0:
            raise ValueError("each row of a forward needs its own live slot")
        for row, count in zip(rows, counts, strict=True):
            self._place(row, row.length + count)
        shared = [count for row, count in zip(rows, counts, strict=True) if not row.private]
        if shared:
            # Writes for slots a group spans but does not feed go past every live row's end.
            needed = max(
                [live.length for live in self._live.values() if not live.private]
                + [r.length + c for r, c in zip(rows, counts, strict=True) if not r.private]
            )
            self._hold_slots([row.slot for row in rows if not row.private])
            self._shared.ensure(needed + max(shared))
        groups, start, lo = [], 0, 0
        while lo < len(rows):
            hi = lo + 1
            if not rows[lo].private:
                kind = counts[lo] > VERIFY_TOKENS
                while (
                    hi < len(rows) and not rows[hi].private and (counts[hi] > VERIFY_TOKENS) == kind
                ):
                    hi += 1
            group = self._group(rows[lo:hi], counts[lo:hi], start)
            groups.append(group)
            start, lo = group.end, hi
        return groups

    def _group(self, rows: list[SlotRow], counts: list[int], start: int) -> SlotGroup:
        """Index maps and the attention mask of one group, shared by every layer."""
        first = min(row.slot for row in rows)
        store, store_first = self._store_of(rows[0])
        store_first -= rows[0].slot - first  # the window's first slot in the store
        kv_heads = self.trunk.inner.layers[0].self_attn.n_kv_heads
        # The compiled attention's mask, for groups whose queries fit one product.
        visible_up_to = self._query_block if self._compiled is not None else 0
        return build_group(
            rows,
            counts,
            start,
            store,
            store_first,
            kv_heads,
            self.attention == "kernel",
            visible_up_to,
        )
