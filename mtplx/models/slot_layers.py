"""How ``SlotTarget`` runs its decoder layers over a forward's packed tokens, in one of three
plans that give the same bits:

- fused kernels (``mtplx.fused_layer``): quantized layers on the CPU with the fused
  attention kernel, each layer one graph node (``fused_layer.layer``), or five (its halves,
  the two KV writes and the attention) where ``layer_node`` is False;
- compiled pieces (``mtplx.models.compiled_layer``): the same ops as the plain layers,
  traced once, a third of the graph-building time;
- plain layers: mlx-lm's modules (over the fused projections where the layer has them,
  ``mtplx.models.fused_projections``) with the slot attention
  (``mtplx.models.slot_attention``).

and, within each, the attention kind: ``"kernel"`` (the fused C kernel, ``mtplx.attention``)
or ``"mlx"`` (MLX ops over the groups' padded layout).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from mtplx import attention as fused_attention
from mtplx import fused_layer
from mtplx.models.compiled_layer import CompiledLayer
from mtplx.models.fused_projections import FusedProjections, fused_linear
from mtplx.models.quantized import (
    InvariantQuantizedEmbedding,
    InvariantQuantizedLinear,
    QuantWeight,
    activation_dtype,
    activations_format,
    weight_arrays,
    weight_of,
)
from mtplx.models.slot_attention import kernel_attention, layer_attention, write_group
from mtplx.models.slot_layout import SlotGroup, padded

__all__ = ["SlotLayers"]


class SlotLayers:
    """The layer plans of ``SlotTarget`` (its attributes are set by ``SlotTarget.__init__``)."""

    trunk: Any
    attention: str  # "kernel" or "mlx": one kind for every forward of a target
    fuses_layers: bool  # the fused-kernel plan (False runs the compiled pieces)
    # Within it, each layer one node (``fused_layer.layer``); False: five nodes a layer
    # (``before``, the two KV writes, the attention, ``after``), the same bits.
    # ``MTPLX_LAYER_NODE=0`` starts targets on the five.
    layer_node: bool = True
    _fused: list[FusedProjections | None]  # per layer
    _fused_args: list[fused_layer.LayerWeights] | None = None  # per layer, once the fused plan runs
    _prepared: list[fused_layer.PreparedLayer] | None = None  # the same, for the layer node
    _compiled: CompiledLayer | None  # the compiled pieces, where they describe the layers
    _query_block: int  # the most queries per head in one product of the MLX-op attention

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

    def _layers(self, x: mx.array, groups: list[SlotGroup], positions: mx.array) -> mx.array:
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
            x = x + layer_attention(
                layer.self_attn,
                layer.input_layernorm(x),
                index,
                groups,
                positions,
                fused,
                self.attention == "kernel",
                self._query_block,
            )
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x), fused)
        return x

    def _compiled_layers(
        self, compiled: CompiledLayer, x: mx.array, groups: list[SlotGroup], positions: mx.array
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
                write_group(store, group, keys_all, values_all, attn.n_kv_heads)
                if self.attention == "kernel":
                    attended.append(kernel_attention(attn, queries_all, store, group))
                    continue
                window = slice(group.store_first, group.store_first + group.num_slots)
                out = compiled.attend(
                    padded(queries_all, group, attn.n_heads),
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
        self, compiled: CompiledLayer, x: mx.array, groups: list[SlotGroup], positions: mx.array
    ) -> mx.array:
        """``_layers`` through the fused kernels (``mtplx.fused_layer``): the compiled pieces'
        bits, one graph node a layer (``layer_node``), or five for a forward of one group."""
        cos, sin = compiled.rope_tables(positions)  # [N, 1, 1, dims / 2], or [1, dims / 2]
        num_tokens = x.shape[-2]
        int8 = activations_format() == "int8"
        if self.layer_node:
            return self._layer_nodes(x, groups, cos, sin, int8)
        for index, args in enumerate(self._fused_layer_args()):
            queries_all, keys_all, values_all = fused_layer.before(
                x,
                args.input_norm,
                args.qkv,
                cos,
                sin,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.rope_dims,
                args.input_eps,
                int8=int8,
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
                        queries, store.keys, store.values, group.slots, group.counts, args.scale
                    )
                )
            x = fused_layer.after(
                x,
                mx.concatenate(attended) if len(attended) > 1 else attended[0],
                args.o_proj,
                args.post_norm,
                args.gate_up,
                args.down,
                args.post_eps,
                int8=int8,
            )
        return x

    def _layer_nodes(
        self, x: mx.array, groups: list[SlotGroup], cos: mx.array, sin: mx.array, int8: bool
    ) -> mx.array:
        """``_fused_layers`` with each layer one node (``fused_layer.layer``): the five nodes'
        C functions in their order, so their bits."""
        # The distinct stores the groups write (groups of one store share its arrays) and
        # each group's index into them; the groups' per-forward inputs, once for every layer.
        owners: list[Any] = []
        for group in groups:
            if not any(group.store is owner for owner in owners):
                owners.append(group.store)
        writes = []
        for group in groups:
            assert group.slots is not None and group.counts is not None
            writes.append(
                fused_layer.GroupWrite(
                    next(i for i, owner in enumerate(owners) if owner is group.store),
                    group.start,
                    group.end,
                    group.write_at,
                    group.to_padded,
                    group.max_tokens,
                    group.slots,
                    group.counts,
                )
            )
        if self._prepared is None:
            self._prepared = [fused_layer.prepare(w) for w in self._fused_layer_args()]
        args = fused_layer.group_args(writes)
        for index, weights in enumerate(self._prepared):
            layers = [owner.layers[index] for owner in owners]
            x, written = fused_layer.layer(
                x, weights, cos, sin, [(s.keys, s.values) for s in layers], args, int8=int8
            )
            for store, (keys, values) in zip(layers, written, strict=True):
                store.keys, store.values = keys, values
        return x

    def _fused_layer_args(self) -> list[fused_layer.LayerWeights]:
        """Each layer's ``fused_layer.LayerWeights`` (its weights are frozen after loading)."""
        if self._fused_args is None:
            plan = []
            for layer, fused in zip(self.trunk.inner.layers, self._fused, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                norm, post = layer.input_layernorm, layer.post_attention_layernorm
                assert fused is not None
                qkv, gate_up = fused.qkv, fused.gate_up
                o_proj, down = weight_of(attn.o_proj), weight_of(mlp.down_proj)
                assert isinstance(qkv, QuantWeight) and isinstance(gate_up, QuantWeight)
                assert isinstance(o_proj, QuantWeight) and isinstance(down, QuantWeight)
                plan.append(
                    fused_layer.LayerWeights(
                        norm.weight,
                        qkv,
                        attn.n_heads,
                        attn.n_kv_heads,
                        attn.head_dim,
                        attn.rope.dims,
                        float(norm.eps),
                        float(attn.scale),
                        o_proj,
                        post.weight,
                        gate_up,
                        down,
                        float(post.eps),
                    )
                )
            self._fused_args = plan
        return self._fused_args

    @staticmethod
    def _mlp(mlp: Any, x: mx.array, fused: FusedProjections | None) -> mx.array:
        """The layer's MLP (mlx-lm's llama MLP), gate and up in one product when fused."""
        if fused is None:
            return mlp(x)
        gate_up = fused_linear(x, fused.gate_up, fused.gate_up_bias)
        size = fused.intermediate
        return mlp.down_proj(swiglu(gate_up[..., :size], gate_up[..., size:]))
