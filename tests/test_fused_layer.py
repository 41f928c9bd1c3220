"""The fused layer kernels (mtplx.fused_layer): each elementwise piece bitwise equal to MLX's
own CPU ops (and to NumPy twins where NumPy computes the same order), each half of a layer
bitwise equal to the compiled pieces it replaces, forwards through them bitwise equal to the
compiled path, one graph node a layer bitwise equal to the five (halves, KV writes,
attention), the KV write in place only when nothing else holds the store."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

from mtplx import fused_layer, quant
from mtplx.models import load
from mtplx.models.quantized import (
    InvariantQuantizedLinear,
    QuantWeight,
    linear,
    weight_arrays,
    weight_of,
)
from mtplx.models.slot_target import SlotTarget
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


@pytest.fixture(scope="module", params=["q4", "q8", "float32"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("fused_layer")
    build_checkpoint("llama_mtp", directory)
    if request.param != "float32":
        quantize_checkpoint(directory, bits=int(request.param[1:]), group_size=64)
    return load(directory)


def _quantized(model) -> bool:
    return isinstance(model.target.trunk.inner.layers[0].mlp.down_proj, InvariantQuantizedLinear)


# -- the elementwise pieces ------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_rms_norm_is_mlx_bits_and_the_numpy_sequential_sum(hidden: int) -> None:
    rng = np.random.default_rng(hidden)
    x = rng.standard_normal((41, hidden)).astype(np.float32) * 3
    x[0] = 0.0  # all zeros: 1 / sqrt(eps)
    x[1] *= 1e4
    x[2] *= 1e-4
    w = rng.standard_normal(hidden).astype(np.float32)
    got = fused_layer.rms_norm(mx.array(x), mx.array(w), 1e-5)
    compiled = mx.compile(lambda a, b: mx.fast.rms_norm(a, b, 1e-5))
    for want in (
        mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5),
        compiled(mx.array(x), mx.array(w)),
    ):
        assert np.array_equal(_bits(got), _bits(want))
    # NumPy twin: squares summed in ascending order in float32 (add.accumulate is sequential)
    total = np.add.accumulate(x * x, axis=-1, dtype=np.float32)[:, -1:]
    inv = np.float32(1.0 / hidden)
    r = np.float32(1.0) / np.sqrt(total * inv + np.float32(1e-5))
    assert np.array_equal(_bits(got), ((x * r) * w).view(np.uint32))


def test_exp_is_mlx_cpu_exp() -> None:
    values = np.concatenate(
        [
            np.linspace(-100, 100, 4001, dtype=np.float32),
            np.float32([0.0, -0.0, 1e-30, -1e-30, 87.99, 88.0, 88.01, -88.0, -88.01, 1e30]),
        ]
    )
    want = _bits(mx.exp(mx.array(values)))
    got = np.float32([fused_layer.exp(float(v)) for v in values]).view(np.uint32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("size", [1536, 37])
def test_swiglu_is_mlx_lm_bits(size: int) -> None:
    """Vector lanes (whole vectors of a row) and the scalar tail (37 = 2 x 16 + 5) alike."""
    rng = np.random.default_rng(3)
    gate_up = rng.standard_normal((9, 2 * size)).astype(np.float32) * 6
    edges = np.float32(
        [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            20,
            -20,
            87.9,
            -87.9,
            88.5,
            -88.5,
            1e3,
            -1e3,
            np.inf,
            -np.inf,
            np.nan,
            61.0,
            -61.0,
            60.99,
            61.01,
            0.34657359,
            -0.34657359,
        ]
    )
    gate_up[0, : len(edges)] = edges[:size]
    # |g| log2(e) next to half-integers: where rounding x to the nearest integer turns
    gate_up[1:, :size] = (rng.integers(-120, 120, (8, size)) + 0.5) / np.float32(1.442695)
    gate_up[1:, :size] += rng.integers(-2, 3, (8, size)) * np.float32(1e-6)
    g = mx.array(gate_up)
    got = fused_layer.swiglu(g)
    for want in (
        mlx_swiglu(g[..., :size], g[..., size:]),
        g[..., :size] * mx.sigmoid(g[..., :size]) * g[..., size:],
    ):
        assert np.array_equal(_bits(got), _bits(want))


def test_swiglu_sweep_is_mlx_lm_bits() -> None:
    """Every 2^-9-spaced gate in [-100, 100] and beyond the exp's bounds, against MLX."""
    gates = np.arange(-100 * 512, 100 * 512, dtype=np.float32) / np.float32(512)
    gates = np.concatenate([gates, np.float32([88.0, -88.0, 88.00001, -88.00001])])
    ups = np.float32(0.75) + np.zeros_like(gates)
    g = mx.array(np.concatenate([gates, ups])[None, :])
    got = fused_layer.swiglu(g)
    size = len(gates)
    assert np.array_equal(_bits(got), _bits(mlx_swiglu(g[..., :size], g[..., size:])))


# -- the halves against the compiled pieces --------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_halves_give_the_compiled_pieces_bits(model, tokens: int) -> None:
    target = SlotTarget(model.target, max_rows=4, attention="kernel")
    if not _quantized(model):
        assert not target.fuses_layers  # float32 layers keep the compiled pieces
        return
    assert target.fuses_layers
    compiled = target._compiled
    assert compiled is not None
    rng = np.random.default_rng(tokens)
    for layer, fused in zip(target.trunk.inner.layers[:2], target._fused, strict=False):
        attn, mlp = layer.self_attn, layer.mlp
        hidden = layer.input_layernorm.weight.shape[0]
        x = mx.array(rng.standard_normal((1, tokens, hidden)).astype(np.float32))
        positions = mx.array(rng.integers(0, 300, tokens).astype(np.int32))
        cos, sin = compiled.rope_tables(positions)
        norm = layer.input_layernorm
        want = compiled.project(x, norm.weight, weight_arrays(fused.qkv), (cos, sin), norm.eps)
        got = fused_layer.before(
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
        for have, expected in zip(got, want, strict=True):
            assert np.array_equal(_bits(have), _bits(expected.reshape(have.shape)))
        attended = mx.array(
            rng.standard_normal((tokens, attn.n_heads * attn.head_dim)).astype(np.float32)
        )
        post = layer.post_attention_layernorm
        want_x = compiled.finish(
            x,
            attended,
            weight_arrays(weight_of(attn.o_proj)),
            post.weight,
            weight_arrays(fused.gate_up),
            weight_arrays(weight_of(mlp.down_proj)),
            post.eps,
        )
        got_x = fused_layer.after(
            x,
            attended,
            weight_of(attn.o_proj),
            post.weight,
            fused.gate_up,
            weight_of(mlp.down_proj),
            post.eps,
        )
        assert got_x.shape == want_x.shape
        assert np.array_equal(_bits(got_x), _bits(want_x))


def _numpy_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The NumPy twin of the kernel's RMSNorm (``test_rms_norm_is_mlx_bits_...``)."""
    total = np.add.accumulate(x * x, axis=-1, dtype=np.float32)[..., -1:]
    inv = np.float32(1.0 / x.shape[-1])
    r = np.float32(1.0) / np.sqrt(total * inv + np.float32(eps))
    return (x * r) * w


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize(("bits", "group"), [(8, 32), (4, 64)])
def test_head_ends_give_the_mlx_pieces_bits(
    activations: str, bits: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generic MTP head's input node (two norms, their concatenation, fc) and output node
    (the norm, the rows asked for, the head's product) give the bits of MLX's ops and the
    invariant product on those rows; the norms are the NumPy twin's."""
    monkeypatch.setenv("MTPLX_ACTIVATIONS", activations)
    rng = np.random.default_rng(bits)
    hidden, vocab, tokens = 64, 96, 5

    def weight(rows: int, cols: int) -> QuantWeight:
        w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1)
        return QuantWeight(*mx.quantize(w, group_size=group, bits=bits), bits, group)

    fc, head = weight(hidden, 2 * hidden), weight(vocab, hidden)
    e_np, h_np = (rng.standard_normal((1, tokens, hidden)).astype(np.float32) * 3 for _ in "eh")
    e_np[0, 0] = 0.0  # all zeros: 1 / sqrt(eps)
    h_np[0, 1] *= 1e4
    w_e, w_h, w_o = (rng.standard_normal(hidden).astype(np.float32) for _ in "eho")
    e, h = mx.array(e_np), mx.array(h_np)
    got = fused_layer.head_into(e, h, mx.array(w_e), 1e-5, mx.array(w_h), 1e-6, fc)
    joined_np = np.concatenate(
        [_numpy_rms_norm(e_np, w_e, 1e-5), _numpy_rms_norm(h_np, w_h, 1e-6)], axis=-1
    )
    joined = mx.concatenate(
        [mx.fast.rms_norm(e, mx.array(w_e), 1e-5), mx.fast.rms_norm(h, mx.array(w_h), 1e-6)],
        axis=-1,
    )
    assert np.array_equal(_bits(joined), joined_np.view(np.uint32))
    assert got.shape == (1, tokens, hidden)
    assert np.array_equal(_bits(got), _bits(linear(joined, fc)))

    normed_np = _numpy_rms_norm(np.array(got), w_o, 1e-5)
    for rows in ([3], [4, 0, 4], []):
        at = mx.array(rows[0] if len(rows) == 1 else rows, mx.int32)  # [] for one row
        logits, normed = fused_layer.head_out(got, at, mx.array(w_o), 1e-5, head)
        assert np.array_equal(_bits(normed), normed_np.view(np.uint32))
        want = linear(mx.array(normed_np[:, rows]), head)  # [1, R, vocab]
        assert logits.shape == (1, len(rows), vocab)
        assert np.array_equal(_bits(logits), _bits(want))


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_halves_split_over_rows_give_the_same_bits(
    model, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt chunk's rows: the halves' row-wise steps (norms, RoPE, SwiGLU, residuals, the
    products' row reordering and 8-bit quantization) split over the product's threads give
    the bits of one thread."""
    if not _quantized(model):
        assert not SlotTarget(model.target, max_rows=4, attention="kernel").fuses_layers
        return
    monkeypatch.setenv("MTPLX_ACTIVATIONS", activations)
    target = SlotTarget(model.target, max_rows=4, attention="kernel")
    compiled = target._compiled
    assert compiled is not None
    layer, fused = target.trunk.inner.layers[0], target._fused[0]
    attn, mlp = layer.self_attn, layer.mlp
    tokens, hidden = 700, layer.input_layernorm.weight.shape[0]
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((1, tokens, hidden)).astype(np.float32))
    attended = mx.array(
        rng.standard_normal((tokens, attn.n_heads * attn.head_dim)).astype(np.float32)
    )
    cos, sin = compiled.rope_tables(mx.arange(tokens, dtype=mx.int32))
    norm, post = layer.input_layernorm, layer.post_attention_layernorm

    def halves() -> list[np.ndarray]:
        got = fused_layer.before(
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
        got_x = fused_layer.after(
            x,
            attended,
            weight_of(attn.o_proj),
            post.weight,
            fused.gate_up,
            weight_of(mlp.down_proj),
            post.eps,
        )
        return [_bits(a) for a in (*got, got_x)]

    extension = quant.load_extension()
    before = extension.threads()
    try:
        quant.set_threads(1)
        alone = halves()
        quant.set_threads(3)
        splits = extension.split_calls()
        split = halves()
        assert extension.split_calls() > splits
    finally:
        quant.set_threads(before)
    for one, many in zip(alone, split, strict=True):
        assert np.array_equal(one, many)


# -- forwards ---------------------------------------------------------------------------------


def _tokens(seed: int, length: int) -> list[int]:
    return [(5 + 7 * seed + 13 * j * j) % 250 + 3 for j in range(length)]


# (row, tokens) per forward: prompt chunks, verify rows beside each other and beside a chunk
# (two groups: the queries of each a slice), a row past the store's first capacity step.
PLAN: list[list[tuple[int, list[int]]]] = [
    [(0, _tokens(0, 30))],
    [(1, _tokens(1, 90))],
    [(0, [3]), (1, [4, 5])],
    [(0, [6, 7, 8]), (1, [9]), (2, _tokens(2, 13))],
    [(2, [1, 2, 3, 4, 5, 6])],
    [(1, _tokens(3, 200))],
    [(0, [11]), (1, [12]), (3, [13, 14])],
    [(3, [1])],
]


def _run(target: SlotTarget) -> list[tuple[mx.array, mx.array]]:
    rows = [target.new_row() for _ in range(4)]
    rows[1].unsettled.append(mx.array(0, mx.int32))  # a lazy trim (of nothing) on one row
    outputs = []
    for number, step in enumerate(PLAN):
        out = target.forward(
            [rows[i] for i, _ in step], [mx.array(t, mx.int32) for _, t in step], "all"
        )
        mx.eval([(o.logits, o.hidden) for o in out])
        outputs += [(o.logits, o.hidden) for o in out]
        if number == 3:
            target.trim_lazily(rows[0], mx.array(2, mx.int32))  # drop 2 of its 3 tokens
    return outputs


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_fused_forwards_give_the_compiled_bits(
    model, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_ACTIVATIONS", activations)
    fused = SlotTarget(model.target, max_rows=8, attention="kernel")
    assert fused.fuses_layers == _quantized(model)
    if not fused.fuses_layers:
        return
    compiled = SlotTarget(model.target, max_rows=8, attention="kernel")
    compiled.fuses_layers = False
    for (logits, hidden), (logits2, hidden2) in zip(_run(compiled), _run(fused), strict=True):
        assert mx.array_equal(logits, logits2).item()
        assert mx.array_equal(hidden, hidden2).item()


def test_fused_forwards_follow_the_activations_mode(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--activations int8`` the fused halves take the integer-dot products, as the
    compiled pieces do: the same bits as those, and not the float mode's."""
    if not _quantized(model):
        return
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "float32")
    float_mode = _run(SlotTarget(model.target, max_rows=8, attention="kernel"))
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "int8")
    fused = SlotTarget(model.target, max_rows=8, attention="kernel")
    assert fused.fuses_layers
    compiled = SlotTarget(model.target, max_rows=8, attention="kernel")
    compiled.fuses_layers = False
    int8_fused, int8_compiled = _run(fused), _run(compiled)
    for (logits, hidden), (logits2, hidden2) in zip(int8_compiled, int8_fused, strict=True):
        assert mx.array_equal(logits, logits2).item()
        assert mx.array_equal(hidden, hidden2).item()
    assert not all(
        mx.array_equal(a, b).item() for (a, _), (b, _) in zip(float_mode, int8_fused, strict=True)
    )


def test_mlx_attention_keeps_the_compiled_pieces(model) -> None:
    assert not SlotTarget(model.target, max_rows=2, attention="mlx").fuses_layers


def _node_names(target: SlotTarget, tmp_path: Path) -> collections.Counter[str]:
    """The graph nodes of a one-token step after a 9-token prompt, by primitive name."""
    row = target.new_row()
    mx.eval(target.forward([row], [mx.array(_tokens(0, 9), mx.int32)], "none")[0].hidden)
    logits = target.forward([row], [mx.array([7], mx.int32)], "all")[0].logits
    mx.export_to_dot(str(tmp_path / "graph.dot"), logits)
    return collections.Counter(re.findall(r'label ="(\w+)"', (tmp_path / "graph.dot").read_text()))


def test_a_forward_is_one_node_a_layer(model, tmp_path: Path) -> None:
    target = SlotTarget(model.target, max_rows=2, attention="kernel")
    if not target.fuses_layers:
        return
    assert target.layer_node
    names = _node_names(target, tmp_path)
    assert names["MTPLXLayer"] == len(target.trunk.inner.layers)
    for name in ("MTPLXLayerBefore", "MTPLXKVWrite", "MTPLXStoreAttention", "MTPLXLayerAfter"):
        assert names[name] == 0, name
    for name in ("Scatter", "Slice", "Transpose", "Concatenate", "Sigmoid", "Rsqrt"):
        assert names[name] <= 1, name


def test_a_forward_is_five_nodes_a_layer_without_the_layer_node(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPLX_LAYER_NODE", "0")
    target = SlotTarget(model.target, max_rows=2, attention="kernel")
    if not target.fuses_layers:
        return
    assert not target.layer_node
    names = _node_names(target, tmp_path)
    layers = len(target.trunk.inner.layers)
    per_layer = {"MTPLXLayerBefore": 1, "MTPLXKVWrite": 2, "MTPLXStoreAttention": 1}
    for name, count in {**per_layer, "MTPLXLayerAfter": 1}.items():
        assert names[name] == count * layers, name
    assert names["MTPLXLayer"] == 0
    # the rest (embedding, RoPE angles, final norm, LM head) is per forward: none of the
    # compiled pieces' per-layer nodes is left
    for name in ("Scatter", "Slice", "Transpose", "Concatenate", "Sigmoid", "Rsqrt"):
        assert names[name] <= 1, name


def _stores(target: SlotTarget) -> list[mx.array]:
    """Every KV array of the target: the shared store's, then each private store's."""
    stores = [target._shared, *(target._private[slot] for slot in sorted(target._private))]
    return [a for store in stores for kv in store.layers for a in (kv.keys, kv.values)]


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("shared_capacity", [None, 160])
def test_one_node_layers_give_the_five_nodes_bits(
    model, activations: str, shared_capacity: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every forward of the plan (prompt chunks, verify rows beside each other and beside a
    chunk, a lazily trimmed row, rows at different offsets; with a small shared capacity a
    row in a store of its own beside the shared rows: two stores in one layer node): the
    logits, the hidden states and every KV array the layer nodes write are the five nodes'
    bits."""
    monkeypatch.setenv("MTPLX_ACTIVATIONS", activations)
    one = SlotTarget(model.target, max_rows=8, attention="kernel")
    if not one.fuses_layers:
        return
    five = SlotTarget(model.target, max_rows=8, attention="kernel")
    five.layer_node = False
    if shared_capacity is not None:
        one.shared_capacity = five.shared_capacity = shared_capacity
    for (logits, hidden), (logits2, hidden2) in zip(_run(five), _run(one), strict=True):
        assert np.array_equal(_bits(logits), _bits(logits2))
        assert np.array_equal(_bits(hidden), _bits(hidden2))
    if shared_capacity is not None:
        assert one._private and sorted(one._private) == sorted(five._private)
    stores_one, stores_five = _stores(one), _stores(five)
    assert len(stores_one) == len(stores_five)
    for a, b in zip(stores_five, stores_one, strict=True):
        assert a.shape == b.shape
        assert np.array_equal(_bits(a), _bits(b))


def test_the_layer_node_writes_the_store_in_place_unless_it_is_held(model) -> None:
    target = SlotTarget(model.target, max_rows=2, attention="kernel")
    if not target.fuses_layers:
        return
    row = target.new_row()
    mx.eval(target.forward([row], [mx.array(_tokens(0, 9), mx.int32)], "none")[0].hidden)
    kv = target._shared.layers[0]
    before = (_pointer(kv.keys), _pointer(kv.values))
    copies = fused_layer.store_copies()
    mx.eval(target.forward([row], [mx.array([7], mx.int32)], "all")[0].logits)
    assert (_pointer(kv.keys), _pointer(kv.values)) == before
    assert fused_layer.store_copies() == copies  # no layer's store copied
    held = kv.keys  # another holder: the layer node must leave it as it is
    held_bits = _bits(held).copy()
    mx.eval(target.forward([row], [mx.array([8], mx.int32)], "all")[0].logits)
    assert fused_layer.store_copies() == copies + 1  # that store only
    assert np.array_equal(_bits(held), held_bits)
    assert _pointer(kv.keys) != _pointer(held)
    assert _pointer(kv.values) == before[1]
    assert not np.array_equal(_bits(kv.keys), held_bits)


# -- the KV write -----------------------------------------------------------------------------


def _pointer(a: mx.array) -> int:
    return int(np.array(a, copy=False).__array_interface__["data"][0])


def test_kv_write_is_in_place_unless_the_store_is_held() -> None:
    rng = np.random.default_rng(5)
    slots, kv, cap, d = 3, 2, 16, 8
    keys = mx.array(rng.standard_normal((slots, kv, cap, d)).astype(np.float32))
    values = mx.array(rng.standard_normal((slots, kv, cap, d + 1)).astype(np.float32))
    mx.eval(keys, values)
    fresh_k = mx.array(rng.standard_normal((4, kv, d)).astype(np.float32))
    fresh_v = mx.array(rng.standard_normal((4, kv, d)).astype(np.float32))
    # rows (slots 1 and 2) of T = 2 tokens: slot 1 feeds packed tokens 0, 1 at positions 5, 6;
    # slot 2 feeds token 2 at position 3 and a pad (token 2 again) at 4
    to_padded = mx.array([0, 1, 2, 2], mx.int32)
    rows = [
        ((s * kv + h) * cap + p)
        for s, p0 in ((1, 5), (2, 3))
        for h in range(kv)
        for p in (p0, p0 + 1)
    ]
    write_at = mx.array(rows, mx.int32)
    expected_k, expected_v = np.array(keys), np.array(values)
    for r, (slot, p0) in enumerate(((1, 5), (2, 3))):
        for h in range(kv):
            for t in range(2):
                token = [0, 1, 2, 2][r * 2 + t]
                expected_k[slot, h, p0 + t] = np.array(fresh_k)[token, h]
                expected_v[slot, h, p0 + t, :d] = np.array(fresh_v)[token, h]
                expected_v[slot, h, p0 + t, d] = 1.0

    held = keys  # another holder: the write must not touch it
    held_bits = np.array(held).copy()
    new_keys, new_values = fused_layer.write(keys, values, fresh_k, fresh_v, write_at, to_padded, 2)
    mx.eval(new_keys, new_values)
    assert np.array_equal(np.array(new_keys), expected_k)
    assert np.array_equal(np.array(new_values), expected_v)
    assert np.array_equal(np.array(held), held_bits)
    assert _pointer(new_keys) != _pointer(held)

    del keys, held, values  # nothing else holds them now: written in place
    before = (_pointer(new_keys), _pointer(new_values))
    again_k, again_v = fused_layer.write(
        new_keys, new_values, fresh_k * 2, fresh_v * 2, write_at, to_padded, 2
    )
    del new_keys, new_values
    mx.eval(again_k, again_v)
    assert (_pointer(again_k), _pointer(again_v)) == before
    assert np.array_equal(np.array(again_k)[1, 0, 5], np.array(fresh_k * 2)[0, 0])
