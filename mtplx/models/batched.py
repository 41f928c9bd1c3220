"""Batched target forwards: the tokens of many sequences, each at its own length, in one forward.

A step of the engine runs one target forward over every running row: row i feeds ``T_i``
tokens (1 for plain decoding, 1 + k when it verifies k draft tokens) after its own ``L_i``
committed ones. Two implementations of the one interface (``BatchedTarget``):

- ``SlotTarget`` (llama-like trunks, the default model): the rows' tokens are packed into
  one ``[1, N]`` sequence (N = sum of T_i) for every matmul, so each weight is read once per
  step for all rows; attention runs per row over a KV store with one slot per row: in the
  fused C kernel (``mtplx.attention``: per packed token and head, over that token's own
  keys) on the CPU, else in MLX ops in a padded ``[R, heads, T_max, L_max]`` layout. A
  row's logits never depend on the other rows, bitwise: the matmuls' batch-invariant
  kernels sum every output element in a fixed order whatever the row count, the fused
  attention computes a token from its own inputs alone, and the MLX-op attention is written
  so that a row's padding (shorter history, fewer tokens than T_max) only appends exact
  zeros to its sums, which the kernel ignores (``mtplx/blas_invariant.c``). A row alone and
  the same row among 15 others give the same bits, and a prompt fed in one forward gives
  the bits of token-by-token decode steps.
- ``PerRowTarget`` (``mtplx.models.per_row``; every other family: recurrent layers, MLA,
  ...): one forward of the model's own code per row, queued together and evaluated at
  once. Exact, not faster.

Rows are created with ``new_row`` and released with ``release``; rejected draft tokens are
dropped with ``trim`` (attention KV) or ``checkpoint`` / ``rollback`` (recurrent state).
``SlotTarget`` also trims lazily (``trim_lazily``: the count is an array still computing), so
the next forward of a drafting row can be built before its verdict is read; ``settle`` reads
the count once it is computed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from mtplx import attention as fused_attention
from mtplx import fused_layer
from mtplx.arrays import scalar_int
from mtplx.blas_shim import INVARIANT_MAX_ROWS
from mtplx.models.base import TargetModel
from mtplx.models.compiled_layer import CompiledLayer
from mtplx.models.kv_store import KV_STEP, SHARED_CAPACITY, KVStore, LayerKV
from mtplx.models.per_row import PerRowTarget
from mtplx.models.quantized import (
    InvariantQuantizedEmbedding,
    InvariantQuantizedLinear,
    QuantWeight,
    activation_dtype,
    linear,
    weight_arrays,
    weight_of,
)
from mtplx.models.rows import BatchedTarget, Row, RowOutput, logits_per_row

__all__ = [
    "BatchedTarget",
    "PerRowTarget",
    "Row",
    "RowOutput",
    "SlotRow",
    "SlotTarget",
    "batched_target",
]

# An idle shared store above this many positions per slot is freed (``SlotTarget.release``).
IDLE_CAPACITY = 2 * KV_STEP
# The compiled attention reads a group's keys up to its key length rounded up to a multiple of
# this, not the store's whole capacity: a coarser step reads more masked keys, a finer one
# makes more shapes (a trace each).
ATTEND_STEP = 64
# Rows feeding at most this many tokens (a verify of up to 5 drafts, plain decoding) attend
# together; longer ones (prefill chunks) in a group of their own.
VERIFY_TOKENS = 8
# A forward's packed tokens when every product runs on the quantized kernel and attention on
# the fused kernel: neither has a row limit (their per-element order does not depend on the
# row count), so a prompt alone feeds this many tokens a forward. The bound keeps a forward's
# scratch arrays small and the shared store's padding (``SlotTarget._place``) short.
UNBOUNDED_PREFILL_TOKENS = 384


# -- packed matmuls, per-row attention over slots -------------------------------------------


@dataclass(eq=False)
class SlotRow:
    """A row of ``SlotTarget``: a slot of the KV store. ``length`` counts the positions
    written; the last ``sum(unsettled)`` of them may be rejected drafts whose count is still
    computing (``SlotTarget.trim_lazily``), so ``length`` is the row's length at most."""

    slot: int
    length: int = 0
    unsettled: list[mx.array] = field(default_factory=list)  # [] int32 lazy trims, oldest first
    # Its KV lives in a store of its own (past ``shared_capacity``): it attends alone.
    private: bool = False

    def shift(self) -> mx.array | None:
        """[] int32 (lazy): the unsettled positions, None when there are none."""
        if not self.unsettled:
            return None
        return functools.reduce(mx.add, self.unsettled)


@dataclass
class _Group:
    """Rows whose attention runs together, padded to one [R, heads, T, L] layout: the slots
    first_slot .. first_slot + R - 1 (those not in the group are computed and discarded), and
    a contiguous segment [start, end) of the forward's packed tokens. ``store`` holds their
    KV, the group's slots from index ``store_first`` on (the shared store: the slot numbers;
    a long row's own store: 0)."""

    first_slot: int
    store: KVStore
    store_first: int
    num_slots: int  # R
    max_tokens: int  # T
    key_length: int  # L: the group's longest row after the forward
    start: int
    end: int
    offsets: mx.array  # [R] int32, each slot's length before the forward
    to_padded: mx.array  # [R * T] int32: packed index of each padded position (pads -> start)
    to_packed: mx.array  # [end - start] int32: padded index of each of the group's tokens
    write_at: mx.array  # [R * kv * T] int32: flat (slot, head, position) index in the store
    mask: mx.array  # [R, 1, T, L] bool: key j visible to query t of row r
    # [R, 1, 1, T, S] bool: the same over the first S = span keys (compiled layers)
    visible: mx.array | None = None
    span: int = 0  # key_length rounded up to ATTEND_STEP, at most the capacity
    # Every slot fed, in slot order, the same number of tokens (plain decoding, a batch of
    # verifies of one depth): the padded layout is the packed one, so spreading to it and
    # gathering back are the identity and need no gather (two graph nodes each, every layer).
    dense: bool = False
    # The fused attention kernel's per-token inputs (``mtplx.attention``), in packed order:
    slots: mx.array | None = None  # [end - start] int32: each token's slot in ``store``
    counts: mx.array | None = None  # [end - start] int32: the keys it sees (position + 1)


@dataclass
class SlotBlockState:
    """A block of one row's positions, saved for the prefix cache: the KV of every layer and
    the post-norm hidden states (what the drafters read)."""

    keys: mx.array  # [layers, kv_heads, B, d]
    values: mx.array  # [layers, kv_heads, B, d + 1]
    hidden: mx.array  # [B, H]
    resumable = True  # a row can continue after any block

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        return self.keys.nbytes + self.values.nbytes + self.hidden.nbytes


@dataclass
class _Fused:
    """One layer's projections that read the same input, as one weight each: q, k and v
    ([q | k | v] rows), the MLP's gate and up ([gate | up] rows). One product instead of three
    (two) costs fewer MLX ops and kernel calls per layer, and gives the same bits: the
    invariant kernel sums every output element in a fixed order over the input alone,
    whatever the other columns of the product."""

    qkv: mx.array | QuantWeight  # [q_out + 2 kv_out, H]
    qkv_bias: mx.array | None
    q_size: int
    kv_size: int
    gate_up: mx.array | QuantWeight  # [2 I, H]
    gate_up_bias: mx.array | None
    intermediate: int


def _fuse(layer: Any) -> _Fused | None:
    """The layer's fused projections (their modules then read slices of them, so the
    weights are held once), or None when they are neither all plain float ``nn.Linear``
    layers nor all kernel-quantized ones of one format without biases."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
    if all(type(m) is InvariantQuantizedLinear for g in groups for m in g):
        return _fuse_quantized(attn, mlp, groups)
    if not all(type(m) is nn.Linear for g in groups for m in g):
        return None
    fused = []
    for modules in groups:
        has_bias = ["bias" in m for m in modules]
        if any(has_bias) and not all(has_bias):
            return None
        weight = mx.concatenate([m.weight for m in modules])
        bias = mx.concatenate([m.bias for m in modules]) if all(has_bias) else None
        mx.eval(weight, bias)
        start = 0
        for m in modules:  # the modules keep working, on views of the fused weight
            size = m.weight.shape[0]
            m.weight = weight[start : start + size]
            if bias is not None:
                m.bias = bias[start : start + size]
            start += size
        mx.eval([(m.weight, m.get("bias")) for m in modules])
        fused.append((weight, bias))
    (qkv, qkv_bias), (gate_up, gate_up_bias) = fused
    return _Fused(
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_size=attn.q_proj.weight.shape[0],
        kv_size=attn.k_proj.weight.shape[0],
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        intermediate=mlp.gate_proj.weight.shape[0],
    )


def _fuse_quantized(attn: Any, mlp: Any, groups: tuple[tuple[Any, ...], ...]) -> _Fused | None:
    """``_fuse`` for kernel-quantized projections: output rows are quantized independently,
    so stacking the packed weights, scales and biases row-wise is exact."""
    fused: list[QuantWeight] = []
    for modules in groups:
        kinds = {m.quant.kind for m in modules}
        if len(kinds) != 1 or any("bias" in m for m in modules):
            return None
        bits, group_size = kinds.pop()
        arrays = [mx.concatenate([m.quant.arrays[i] for m in modules]) for i in range(3)]
        mx.eval(arrays)
        start = 0
        for m in modules:  # the modules keep working, on views of the fused arrays
            size = m.weight.shape[0]
            m.weight, m.scales, m.biases = (a[start : start + size] for a in arrays)
            start += size
        mx.eval([(m.weight, m.scales, m.biases) for m in modules])
        weight, scales, biases = arrays
        fused.append(QuantWeight(weight, scales, biases, bits, group_size))
    qkv, gate_up = fused
    return _Fused(
        qkv=qkv,
        qkv_bias=None,
        q_size=attn.q_proj.weight.shape[0],
        kv_size=attn.k_proj.weight.shape[0],
        gate_up=gate_up,
        gate_up_bias=None,
        intermediate=mlp.gate_proj.weight.shape[0],
    )


def _linear(x: mx.array, weight: mx.array | QuantWeight, bias: mx.array | None) -> mx.array:
    """What ``nn.Linear`` (or the kernel-quantized layer) computes, for a fused weight."""
    if isinstance(weight, QuantWeight):
        y = linear(x, weight)
        return y if bias is None else y + bias
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


class SlotTarget:
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
        self._shared = self._new_store(max_rows)  # every slot, up to shared_capacity long
        self._private: dict[int, KVStore] = {}  # slot -> the store of a row past it
        # An attention product has (heads / kv heads) x (queries) rows: queries go in blocks
        # that keep it within the invariant kernel, like every matmul of a forward of at
        # most INVARIANT_MAX_ROWS tokens, so a prompt's cache is the same bits however it
        # is chunked and whatever shares its forwards.
        first = self.trunk.inner.layers[0].self_attn
        repeats = first.n_heads // first.n_kv_heads
        self._query_block = max(INVARIANT_MAX_ROWS // repeats, 1)
        self._prefill_tokens = INVARIANT_MAX_ROWS
        self._fused = [_fuse(layer) for layer in self.trunk.inner.layers]
        self._compiled = CompiledLayer.for_trunk(list(self.trunk.inner.layers), self._fused)
        self.attention = self._attention_kind(attention)
        # Quantized layers on the CPU: each half of a layer one fused kernel (mtplx.fused_layer:
        # the compiled pieces' bits in five graph nodes a layer instead of ~50). False runs
        # the compiled pieces, e.g. to compare the two.
        self.fuses_layers = self._fuses_layers()
        if self.attention == "kernel" and self._products_unbounded():
            # No product of a forward goes through the row-limited BLAS kernel: a prompt
            # alone may feed hundreds of tokens a forward (``Engine._prefill_piece``).
            self._prefill_tokens = UNBOUNDED_PREFILL_TOKENS
            self.max_packed_rows = UNBOUNDED_PREFILL_TOKENS

    @property
    def max_prefill_tokens(self) -> int:
        """The most prompt tokens a row feeds in one forward (the engine's largest piece):
        the products' row limit, and at most half the shared store (a shared row's chunk is
        the store's padding, ``_place``), never below INVARIANT_MAX_ROWS."""
        return min(self._prefill_tokens, max(INVARIANT_MAX_ROWS, self.shared_capacity // 2))

    def _attention_kind(self, wanted: str | None) -> str:
        """``"kernel"`` or ``"mlx"`` (see the class docstring)."""
        wanted = wanted or os.environ.get("MTPLX_ATTENTION", "").strip().lower() or None
        if wanted not in (None, "kernel", "mlx"):
            raise ValueError(f"attention must be 'kernel' or 'mlx', not {wanted!r}")
        dtype = activation_dtype(self.trunk.inner)
        if wanted == "mlx" or not fused_attention.available(dtype):
            if wanted == "kernel":
                raise RuntimeError("the fused attention kernel does not serve this model here")
            return "mlx"
        return "kernel"

    def _fuses_layers(self) -> bool:
        """Whether the layers run as fused kernels (``mtplx.fused_layer``): the compiled
        pieces describe them with mlx's plain RoPE (hoisted), attention is the fused kernel's
        and every layer product is kernel-quantized."""
        compiled = self._compiled
        if compiled is None or not compiled.hoists_rope or self.attention != "kernel":
            return False
        for layer, fused in zip(self.trunk.inner.layers, self._fused, strict=True):
            assert fused is not None  # the compiled pieces describe fused layers only
            weights = (fused.qkv, fused.gate_up, weight_of(layer.self_attn.o_proj))
            if not all(
                isinstance(w, QuantWeight) for w in (*weights, weight_of(layer.mlp.down_proj))
            ):
                return False
        return fused_layer.available()

    def _products_unbounded(self) -> bool:
        """Whether every product of a forward runs on the quantized kernel (no row limit):
        the fused projections, o_proj, down_proj and the LM head."""
        if any(fused is None for fused in self._fused):
            return False
        weights: list[Any] = []
        for layer, fused in zip(self.trunk.inner.layers, self._fused, strict=True):
            assert fused is not None
            weights += [fused.qkv, fused.gate_up]
            weights += [weight_of(layer.self_attn.o_proj), weight_of(layer.mlp.down_proj)]
        owner, inner = self.trunk.owner, self.trunk.inner
        head = owner.lm_head if "lm_head" in owner else inner.embed_tokens
        quantized_head = type(head) in (InvariantQuantizedLinear, InvariantQuantizedEmbedding)
        return quantized_head and all(isinstance(w, QuantWeight) for w in weights)

    def _new_store(self, num_slots: int) -> KVStore:
        attention = self.trunk.inner.layers[0].self_attn
        return KVStore(
            num_slots=num_slots,
            num_layers=len(self.trunk.inner.layers),
            kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim,
            hidden_size=self.hidden_size,
            dtype=activation_dtype(self.trunk.inner),
            keep_hidden=self.keep_hidden,
        )

    @property
    def kv_nbytes(self) -> int:
        """Bytes of KV (and hidden states) held: the shared store and the long rows'."""
        return self._shared.nbytes + sum(store.nbytes for store in self._private.values())

    # -- rows ---------------------------------------------------------------------------

    def new_row(self) -> SlotRow:
        """The lowest free slot (so the slots in use stay dense at the front)."""
        if not self._free:
            raise RuntimeError(f"all {self.max_rows} slots are in use")
        self._free.sort()
        row = SlotRow(self._free.pop(0))
        self._live[row.slot] = row
        return row

    def release(self, row: SlotRow) -> None:
        """Return the row's slot; its stale KV is never read (reads stop at a row's length).
        A long row's own store is freed with it."""
        row.unsettled = []
        freed = row.private and self._private.pop(row.slot, None) is not None
        row.private = False
        if row.slot >= 0:
            del self._live[row.slot]
            self._free.append(row.slot)
            row.slot = -1
        if not self._live and self._shared.capacity > IDLE_CAPACITY:
            # The shared store grows every slot to the longest row it holds and never
            # shrinks while rows run: once none is left, give that memory back (the next
            # forward allocates afresh; saved prefix blocks are copies).
            self._shared.free()
            freed = True
        if freed:
            _return_freed_memory()

    def trim(self, row: SlotRow, num_tokens: int) -> None:
        """Forget the last positions; their KV entries are overwritten by later writes."""
        row.length -= min(num_tokens, row.length)

    trims_lazily = True

    def trim_lazily(self, row: SlotRow, num_tokens: mx.array) -> None:
        """``trim`` by a count still computing ([] int32): later forwards of the row write
        and attend as if it were trimmed; ``settle`` applies it to ``row.length``."""
        row.unsettled.append(num_tokens.astype(mx.int32))

    def settle(self, row: SlotRow) -> int:
        """Read the row's oldest lazy trim (its verdict must be computed or computing) and
        apply it; returns the count."""
        num_tokens = scalar_int(row.unsettled.pop(0))
        row.length -= num_tokens
        return num_tokens

    def checkpoint(self, row: SlotRow) -> int:
        """The row's length."""
        return row.length

    def rollback(self, row: SlotRow, point: int) -> None:
        """Back to a length."""
        row.length = point

    # -- prefix cache -------------------------------------------------------------------

    def unevaluated(self) -> list[mx.array]:
        """State a forward updated that no output depends on (the hidden-state store):
        evaluate it with the forward's outputs, or its updates pile up unevaluated."""
        stores = [self._shared, *self._private.values()]
        return [store.hidden for store in stores if store.hidden is not None]

    def block_nbytes(self, num_positions: int) -> int:
        """Bytes of a ``save_block`` state of ``num_positions`` positions."""
        attention = self.trunk.inner.layers[0].self_attn
        per_position = (
            len(self.trunk.inner.layers)
            * attention.n_kv_heads
            * (
                2 * attention.head_dim + 1  # keys, values and their constant-1 feature
            )
            + self.hidden_size
        )
        return num_positions * per_position * activation_dtype(self.trunk.inner).size

    saves_blocks = True
    resumes_anywhere = True  # the slot store: bitwise the same states however fed
    calibration_key: str | None = None

    def save_block(
        self, row: SlotRow, start: int, end: int, hidden: mx.array | None = None
    ) -> SlotBlockState:
        """A copy of the row's states at positions [start, end) (all computed; the slots
        keep hidden states themselves, ``hidden`` is not needed)."""
        store, index = self._store_of(row)
        if not 0 <= start < end <= row.length or store.hidden is None:
            raise ValueError(f"positions [{start}, {end}) are not in the row")
        state = SlotBlockState(
            mx.stack([layer.keys[index, :, start:end] for layer in store.layers]),
            mx.stack([layer.values[index, :, start:end] for layer in store.layers]),
            mx.contiguous(store.hidden[index, start:end]),  # a copy, not a view of the store
        )
        mx.eval(state.keys, state.values, state.hidden)
        return state

    def load_blocks(self, row: SlotRow, states: Sequence[SlotBlockState]) -> mx.array:
        """Append saved blocks to the row, as if their tokens had been fed; returns their
        hidden states [sum B, H]."""
        keys = mx.concatenate([state.keys for state in states], axis=2)
        values = mx.concatenate([state.values for state in states], axis=2)
        hidden = mx.concatenate([state.hidden for state in states])
        start, end = row.length, row.length + hidden.shape[0]
        self._place(row, end)
        store, index = self._store_of(row)
        store.ensure(end)
        for number, layer in enumerate(store.layers):
            layer.keys[index, :, start:end] = keys[number]
            layer.values[index, :, start:end] = values[number]
        assert store.hidden is not None
        store.hidden[index, start:end] = hidden
        row.length = end
        return hidden

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
        positions = packed_positions(rows, counts)
        if (shifts := _shifts(rows, counts)) is not None:
            positions = positions - shifts
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
        groups: list[_Group],
        positions: mx.array,
    ) -> mx.array:
        """The trunk's decoder layers over the packed tokens: x [1, N, H] embedded ->
        [1, N, H] before the final norm. (A pipeline stage runs its own range of layers
        here and exchanges x with the other ranks: ``mtplx.distributed``.)"""
        return self._layers(x, groups, positions)

    def _layers(self, x: mx.array, groups: list[_Group], positions: mx.array) -> mx.array:
        """This target's layers (all of the trunk's, or a pipeline stage's): [1, N, H] ->
        [1, N, H]."""
        compiled = self._compiled
        if compiled is not None and self.fuses_layers:
            return self._fused_layers(compiled, x, groups, positions)
        if compiled is not None and (
            self.attention == "kernel" or all(g.visible is not None for g in groups)
        ):
            return self._compiled_layers(compiled, x, groups, positions)
        for index, (layer, fused) in enumerate(
            zip(self.trunk.inner.layers, self._fused, strict=True)
        ):
            x = x + self._attention(
                layer.self_attn, layer.input_layernorm(x), index, groups, positions, fused
            )
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x), fused)
        return x

    def _compiled_layers(
        self, compiled: CompiledLayer, x: mx.array, groups: list[_Group], positions: mx.array
    ) -> mx.array:
        """``_layers`` through the compiled pieces (``mtplx.models.compiled_layer``): the same
        ops, the same bits, a third of the graph-building time."""
        # The RoPE angles depend on the positions only: computed once for every layer.
        rotation = compiled.rope_tables(positions) if compiled.hoists_rope else positions
        for index, (layer, fused) in enumerate(
            zip(self.trunk.inner.layers, self._fused, strict=True)
        ):
            attn, norm = layer.self_attn, layer.input_layernorm
            assert fused is not None  # the compiled pieces describe fused layers only
            queries_all, keys_all, values_all = compiled.project(
                x, norm.weight, weight_arrays(fused.qkv), rotation, norm.eps
            )
            attended = []
            for group in groups:
                store = group.store.layers[index]
                self._write_group(store, group, keys_all, values_all, attn.n_kv_heads)
                if self.attention == "kernel":
                    attended.append(self._kernel_attention(attn, queries_all, store, group))
                    continue
                window = slice(group.store_first, group.store_first + group.num_slots)
                out = compiled.attend(
                    _padded(queries_all, group, attn.n_heads),
                    store.keys[window, :, : group.span].transpose(0, 1, 3, 2),  # [R, kv, d, S]
                    store.values[window, :, : group.span],  # [R, kv, S, d+1]
                    group.visible,
                    attn.scale,
                )
                attended.append(out if group.dense else out[group.to_packed])
            norm = layer.post_attention_layernorm
            x = compiled.finish(
                x,
                mx.concatenate(attended) if len(attended) > 1 else attended[0],
                weight_arrays(weight_of(attn.o_proj)),
                norm.weight,
                weight_arrays(fused.gate_up),
                weight_arrays(weight_of(layer.mlp.down_proj)),
                norm.eps,
            )
        return x

    def _fused_layers(
        self, compiled: CompiledLayer, x: mx.array, groups: list[_Group], positions: mx.array
    ) -> mx.array:
        """``_layers`` through the fused kernels (``mtplx.fused_layer``): the compiled pieces'
        bits, five graph nodes a layer for a forward of one group."""
        cos, sin = compiled.rope_tables(positions)  # [N, 1, 1, dims / 2], or [1, dims / 2]
        num_tokens = x.shape[-2]
        for index, (layer, fused) in enumerate(
            zip(self.trunk.inner.layers, self._fused, strict=True)
        ):
            attn, norm = layer.self_attn, layer.input_layernorm
            assert fused is not None and isinstance(fused.qkv, QuantWeight)
            queries_all, keys_all, values_all = fused_layer.before(
                x,
                norm.weight,
                fused.qkv,
                cos,
                sin,
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                attn.rope.dims,
                norm.eps,
            )
            attended = []
            for group in groups:
                assert group.slots is not None and group.counts is not None
                store = group.store.layers[index]
                store.keys, store.values = fused_layer.write(
                    store.keys,
                    store.values,
                    keys_all,
                    values_all,
                    group.write_at,
                    group.to_padded,
                    group.max_tokens,
                )
                queries = queries_all
                if (group.start, group.end) != (0, num_tokens):
                    queries = queries_all[group.start : group.end]
                attended.append(
                    fused_attention.attend(
                        queries, store.keys, store.values, group.slots, group.counts, attn.scale
                    )
                )
            norm = layer.post_attention_layernorm
            o_proj, down = weight_of(attn.o_proj), weight_of(layer.mlp.down_proj)
            assert isinstance(o_proj, QuantWeight) and isinstance(down, QuantWeight)
            assert isinstance(fused.gate_up, QuantWeight)
            x = fused_layer.after(
                x,
                mx.concatenate(attended) if len(attended) > 1 else attended[0],
                o_proj,
                norm.weight,
                fused.gate_up,
                down,
                norm.eps,
            )
        return x

    def _keep_hidden(self, rows: list[SlotRow], counts: list[int], hidden: mx.array) -> None:
        """Store each fed position's hidden state (hidden: [N, H] packed) in its row's store."""
        if not self.keep_hidden:
            return
        shifts = _shifts(rows, counts)
        by_store: dict[int, tuple[KVStore, list[int], list[int]]] = {}
        packed = 0
        for row, count in zip(rows, counts, strict=True):
            store, index = self._store_of(row)
            _, positions, picked = by_store.setdefault(id(store), (store, [], []))
            positions.extend(index * store.capacity + row.length + t for t in range(count))
            picked.extend(range(packed, packed + count))
            packed += count
        for store, positions, picked in by_store.values():
            assert store.hidden is not None
            at = mx.array(positions, mx.int32)
            fed = mx.array(picked, mx.int32)
            if shifts is not None:
                at = at - shifts[fed]
            flat = store.hidden.reshape(store.num_slots * store.capacity, -1)
            flat[at] = hidden[fed]
            store.hidden = flat.reshape(store.hidden.shape)

    def _groups(self, rows: list[SlotRow], counts: list[int]) -> list[_Group]:
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

    def _place(self, row: SlotRow, needed: int) -> None:
        """Make room for the row's first ``needed`` positions: a row that outgrows
        ``shared_capacity`` moves to a store of its own (its KV so far copied over), which then
        grows with it by a quarter of its length at a time."""
        # The shared store holds its rows' ends plus a forward's padding (at most
        # max_prefill_tokens): a row goes once that could take it past shared_capacity.
        if not row.private and needed + self.max_prefill_tokens > self.shared_capacity:
            row.private = True
        if not row.private:
            # A pipeline stage mirrors rows: a slot it held a long row in now holds a short one.
            if self._private.pop(row.slot, None) is not None:
                _return_freed_memory()
            return
        store = self._private.get(row.slot)
        if store is None:
            store = self._private[row.slot] = self._new_store(1)
            store.ensure(needed)
            store.copy_slot(self._shared, row.slot, 0, min(row.length, self._shared.capacity))
        store.ensure(needed, min_growth=store.capacity // 4)

    def _store_of(self, row: SlotRow) -> tuple[KVStore, int]:
        """The store holding the row's KV and the row's slot index in it."""
        if row.private:
            return self._private[row.slot], 0
        return self._shared, row.slot

    def _group(self, rows: list[SlotRow], counts: list[int], start: int) -> _Group:
        """Index maps and the attention mask of one group, shared by every layer."""
        slots = [row.slot for row in rows]
        first, last = min(slots), max(slots)
        store, store_first = self._store_of(rows[0])
        store_first -= rows[0].slot - first  # the window's first slot in the store
        num_slots, max_tokens = last - first + 1, max(counts)
        fed = {row.slot: row for row in rows}
        lengths = [fed[slot].length if slot in fed else 0 for slot in range(first, last + 1)]
        to_padded = [start] * (num_slots * max_tokens)
        to_packed = []
        position = start
        for row, count in zip(rows, counts, strict=True):
            base = (row.slot - first) * max_tokens
            for t in range(count):
                to_padded[base + t] = position + t
                to_packed.append(base + t)
            position += count
        garbage = store.capacity - max_tokens  # past every live row (see _groups)
        kv_heads = self.trunk.inner.layers[0].self_attn.n_kv_heads
        write_at = [
            ((store_first + r) * kv_heads + h) * store.capacity
            + (lengths[r] if first + r in fed else garbage)
            + t
            for r in range(num_slots)
            for h in range(kv_heads)
            for t in range(max_tokens)
        ]
        offsets = mx.array(lengths, mx.int32)
        write_to = mx.array(write_at, mx.int32)
        slot_rows = [fed.get(slot) for slot in range(first, last + 1)]
        if any(row is not None and row.unsettled for row in slot_rows):
            # Rows with lazy trims: their offsets and write positions come down by them.
            shifts = mx.stack([_shift_or_zero(row) for row in slot_rows])  # [R]
            offsets = offsets - shifts
            write_to = write_to - mx.repeat(shifts, kv_heads * max_tokens)
        key_length = max(lengths) + max_tokens
        query_end = offsets[:, None] + mx.arange(max_tokens)[None, :]  # [R, T]
        mask = mx.arange(key_length)[None, None, :] <= query_end[:, :, None]  # [R, T, L]
        # What the attention kind reads (None otherwise): the fused kernel's per-token slots
        # and key counts, the compiled attention's mask.
        visible: mx.array | None = None
        token_slots: mx.array | None = None
        counts_seen: mx.array | None = None
        span = min(-(-key_length // ATTEND_STEP) * ATTEND_STEP, store.capacity)
        if self.attention == "kernel":
            # Per packed token: its slot in the store, and the keys it sees (its row's offset,
            # lazy trims included, + its index in the row's tokens + 1).
            window = [
                row.slot - first for row, c in zip(rows, counts, strict=True) for _ in range(c)
            ]
            steps = [t + 1 for c in counts for t in range(c)]
            token_slots = mx.array([store_first + r for r in window], mx.int32)
            counts_seen = offsets[mx.array(window, mx.int32)] + mx.array(steps, mx.int32)
        elif self._compiled is not None and max_tokens <= self._query_block:
            visible = mx.arange(span)[None, None, :] <= query_end[:, :, None]
            visible = visible[:, None, None]  # [R, 1, 1, T, S]
        dense = len(to_padded) == position - start and to_padded == list(range(start, position))
        return _Group(
            first_slot=first,
            store=store,
            store_first=store_first,
            num_slots=num_slots,
            max_tokens=max_tokens,
            key_length=key_length,
            start=start,
            end=position,
            offsets=offsets,
            to_padded=mx.array(to_padded, mx.int32),
            to_packed=mx.array(to_packed, mx.int32),
            write_at=write_to,
            mask=mask[:, None],
            visible=visible,
            span=span,
            dense=dense,
            slots=token_slots,
            counts=counts_seen,
        )

    def _ensure_capacity(self, positions: int) -> None:
        """Grow the shared store (all slots) to hold ``positions`` per slot."""
        self._shared.ensure(positions)

    @staticmethod
    def _mlp(mlp: Any, x: mx.array, fused: _Fused | None) -> mx.array:
        """The layer's MLP (mlx-lm's llama MLP), gate and up in one product when fused."""
        if fused is None:
            return mlp(x)
        gate_up = _linear(x, fused.gate_up, fused.gate_up_bias)
        size = fused.intermediate
        return mlp.down_proj(swiglu(gate_up[..., :size], gate_up[..., size:]))

    def _attention(
        self,
        attn: Any,
        x: mx.array,
        layer_index: int,
        groups: list[_Group],
        positions: mx.array,
        fused: _Fused | None = None,
    ) -> mx.array:
        """Self-attention of mlx-lm's llama Attention over the slot store, group by group.

        x: [1, N, H] packed -> [1, N, H]. The softmax is exp(s - max) normalised by a
        matmul with ones: both sums then run through the invariant kernel, to which the
        masked keys past a row's length are trailing zeros (MLX's own softmax would vectorise
        a longer row differently).

        RoPE runs on the packed tokens (each its own batch entry at its own position), before
        they are spread to the groups' padded layout: the same values, without the pads, and
        queries and keys of a fused projection in one call."""
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        num_tokens = x.shape[1]
        if fused is None:
            queries_all = attn.q_proj(x)[0].reshape(num_tokens, heads, 1, -1)
            keys_all = attn.k_proj(x)[0].reshape(num_tokens, kv_heads, 1, -1)
            values_all = attn.v_proj(x)[0].reshape(num_tokens, kv_heads, 1, -1)
            queries_all = attn.rope(queries_all, offset=positions)
            keys_all = attn.rope(keys_all, offset=positions)
        else:
            qkv = _linear(x, fused.qkv, fused.qkv_bias)[0]
            k_end = fused.q_size + fused.kv_size
            roped = attn.rope(
                qkv[:, :k_end].reshape(num_tokens, heads + kv_heads, 1, -1), offset=positions
            )
            queries_all, keys_all = roped[:, :heads], roped[:, heads:]
            values_all = qkv[:, k_end:].reshape(num_tokens, kv_heads, 1, -1)
        attended = [
            self._group_attention(
                attn, queries_all, keys_all, values_all, group.store.layers[layer_index], group
            )
            for group in groups
        ]
        return attn.o_proj((mx.concatenate(attended) if len(attended) > 1 else attended[0])[None])

    @staticmethod
    def _write_group(
        store: LayerKV,
        group: _Group,
        keys_all: mx.array,
        values_all: mx.array,
        kv_heads: int,
    ) -> None:
        """Write a group's new keys and values ([N, kv, 1, d] of every packed token) at each
        row's positions (pads too: past the row's length, so never read). The store is updated
        in place (MLX donates its buffer) as long as nothing else holds it."""
        keys = _padded(keys_all, group, kv_heads)
        values = _padded(values_all, group, kv_heads)
        # Values carry a constant 1 as their last feature, so one product gives both the
        # weighted sum and the softmax's normaliser: a one-column product (the normaliser on
        # its own) is a matrix-vector call that bypasses the invariant kernel.
        values = mx.concatenate([values, _ones((*values.shape[:-1], 1), values.dtype)], -1)
        for name, new in (("keys", keys), ("values", values)):
            stored = getattr(store, name)
            width = stored.shape[-1]
            flat = stored.reshape(-1, width)
            flat[group.write_at] = new.reshape(-1, width)  # [R, kv, T, w]: write_at's order
            setattr(store, name, flat.reshape(stored.shape))

    def _group_attention(
        self,
        attn: Any,
        queries_all: mx.array,
        keys_all: mx.array,
        values_all: mx.array,
        store: LayerKV,
        group: _Group,
    ) -> mx.array:
        """One group: projections [N, heads, 1, d] of every packed token (queries and keys
        roped) -> [tokens, H]."""
        rows, tokens, keys_len = group.num_slots, group.max_tokens, group.key_length
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        repeats = heads // kv_heads

        self._write_group(store, group, keys_all, values_all, kv_heads)
        if self.attention == "kernel":
            return self._kernel_attention(attn, queries_all, store, group)
        queries = _padded(queries_all, group, heads)
        head_dim = queries.shape[-1]
        # Read slots [first, first + R) up to L.
        window = slice(group.store_first, group.store_first + rows)
        all_keys = store.keys[window, :, :keys_len].transpose(0, 1, 3, 2)  # [R, kv, d, L]
        all_values = store.values[window, :, :keys_len]  # [R, kv, L, d+1]

        scaled = queries * attn.scale  # [R, heads, T, d]
        blocks = []
        for start in range(0, tokens, self._query_block):
            # Queries in blocks: each product has repeats x block rows, within the kernel.
            block = min(self._query_block, tokens - start)
            grouped = scaled[:, :, start : start + block].reshape(
                rows, kv_heads, repeats * block, head_dim
            )
            scores = grouped @ all_keys  # [R, kv, repeats * block, L]
            scores = scores.reshape(rows, kv_heads, repeats, block, keys_len)
            visible = group.mask[:, :, None, start : start + block]
            scores = mx.where(visible, scores, -mx.inf)
            weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
            weights = weights.reshape(rows, kv_heads, repeats * block, keys_len)
            summed = weights @ all_values  # [R, kv, repeats * block, d+1]
            attended = summed[..., :head_dim] / summed[..., head_dim:]
            blocks.append(attended.reshape(rows, heads, block, head_dim))
        attended = mx.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
        attended = attended.transpose(0, 2, 1, 3)  # [R, T, heads, d]
        attended = attended.reshape(rows * tokens, heads * head_dim)
        return attended if group.dense else attended[group.to_packed]

    @staticmethod
    def _kernel_attention(
        attn: Any, queries_all: mx.array, store: LayerKV, group: _Group
    ) -> mx.array:
        """A group's attention in the fused kernel, straight from the packed queries
        ([N, heads, 1, d], roped) over the store (its new KV written): -> [tokens, H]."""
        assert group.slots is not None and group.counts is not None
        queries = queries_all
        if (group.start, group.end) != (0, queries_all.shape[0]):
            queries = queries_all[group.start : group.end]
        queries = queries.reshape(group.end - group.start, attn.n_heads, -1)
        return fused_attention.attend(
            queries, store.keys, store.values, group.slots, group.counts, attn.scale
        )


def _return_freed_memory() -> None:
    """Hand freed buffers back to the system: MLX keeps them for reuse, and glibc keeps
    freed heap pages (buffers of tens of MB come from its heap once it has freed a few)."""
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # musl and others: no malloc_trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


@functools.lru_cache(maxsize=64)
def _ones(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """An evaluated array of ones: a constant of the graph, where ``mx.ones`` would add two
    nodes to every layer of every forward."""
    ones = mx.ones(shape, dtype)
    mx.eval(ones)
    return ones


def _padded(projected: mx.array, group: _Group, num_heads: int) -> mx.array:
    """A group's share of packed projections in its padded layout: [N, heads, 1, d] ->
    [R, heads, T, d] (pads repeat the group's first token)."""
    if not group.dense:
        spread = projected[group.to_padded]
    elif group.start == 0 and group.end == projected.shape[0]:
        spread = projected
    else:
        spread = projected[group.start : group.end]
    return spread.reshape(group.num_slots, group.max_tokens, num_heads, -1).transpose(0, 2, 1, 3)


def _shifts(rows: Sequence[SlotRow], counts: Sequence[int]) -> mx.array | None:
    """[N] int32 (lazy): each packed token's row's unsettled positions (``SlotRow.shift``),
    None when no row has any."""
    if not any(row.unsettled for row in rows):
        return None
    return mx.concatenate(
        [
            mx.broadcast_to(_shift_or_zero(row), (count,))
            for row, count in zip(rows, counts, strict=True)
        ]
    )


def _shift_or_zero(row: SlotRow | None) -> mx.array:
    """[] int32: the row's unsettled positions (0 for no row)."""
    shift = None if row is None else row.shift()
    return mx.zeros((), mx.int32) if shift is None else shift


def packed_positions(rows: Sequence[SlotRow], counts: Sequence[int]) -> mx.array:
    """Each packed token's position in its row, for RoPE on the packed projections: [N]."""
    return mx.array(
        [row.length + t for row, count in zip(rows, counts, strict=True) for t in range(count)],
        mx.int32,
    )


def batched_target(
    target: TargetModel, max_rows: int, keep_hidden: bool = False
) -> BatchedTarget[Any]:
    """The fastest exact batched form of ``target``: slots for mlx-lm's llama trunks, one
    forward per row otherwise. ``keep_hidden``: slots keep every position's hidden state,
    so that blocks of them can be saved for the prefix cache."""
    trunk = getattr(target, "trunk", None)
    if trunk is not None and trunk.arch == "llama" and type(target).__name__ == "MLXTarget":
        return SlotTarget(target, max_rows, keep_hidden)
    return PerRowTarget(target)
