"""Finding a checkpoint on disk (or on the hub) and reading its files without building a model:
``config.json``, the safetensors headers, and the MTP tensors that mlx-lm does not load."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

# What to fetch from the hub: config, tokenizer, model shards and separate MTP files.
HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "mtp*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or field."""


def resolve_model_path(model: str | Path) -> Path:
    """A local checkpoint directory for ``model``: the directory itself, or a hub snapshot.

    Raises FileNotFoundError naming the path (or the repo, when the download fails)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path {str(path)!r} is a file, not a checkpoint directory"
            )
        return path
    text = str(model)
    if isinstance(model, Path) or text.startswith((".", "/", "~")) or not _REPO_ID.match(text):
        raise FileNotFoundError(f"model directory {text!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as error:  # offline, unknown repo, gated repo, ...
        raise FileNotFoundError(
            f"model {text!r} is not a local directory, and downloading the hub repo {text!r} "
            f"failed: {type(error).__name__}: {error}"
        ) from error


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint, checked for a ``model_type`` field."""
    file = directory / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a checkpoint directory needs config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(config, dict) or not config.get("model_type"):
        raise CheckpointError(f"{file} has no 'model_type' field")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (``text_config`` of multimodal wrappers)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def context_length(config: dict[str, Any], default: int = 2048) -> int:
    """The longest context the config declares."""
    text = text_config(config)
    for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions"):
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return default


def model_files(directory: Path) -> list[Path]:
    """The model shards mlx-lm loads (``model*.safetensors``), checked to exist."""
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors weight files in {directory}")
    return files


def mtp_files(directory: Path, mtp_weights: str | Path | None = None) -> list[Path]:
    """Separate MTP weight files: ``mtp_weights`` (a file, or a directory of
    ``mtp*.safetensors``) or the checkpoint's own ``mtp*.safetensors``."""
    if mtp_weights is None:
        return sorted(directory.glob("mtp*.safetensors"))
    path = Path(mtp_weights).expanduser()
    if path.is_dir():
        files = sorted(path.glob("mtp*.safetensors")) or sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors MTP weight files in {path}")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"MTP weight file {str(path)!r} does not exist")
    return [path]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]
    file: Path


def read_safetensors_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors, metadata) from a safetensors header, validated against the file size."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length <= 0 or length > size - 8:
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(handle.read(length))
        tensors: dict[str, TensorInfo] = {}
        metadata = header.pop("__metadata__", None) or {}
        data_size = size - 8 - length
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            if not 0 <= start <= end <= data_size:
                raise ValueError(f"tensor {name!r} lies outside the file")
            tensors[name] = TensorInfo(entry["dtype"], tuple(entry["shape"]), file)
        return tensors, metadata
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
        raise CheckpointError(f"{file} is not a valid safetensors file: {error}") from error


def check_weight_files(files: list[Path]) -> dict[str, TensorInfo]:
    """Validate every file's header; the union of their tensors."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(read_safetensors_header(file)[0])
    return tensors


@dataclass
class MTPTensors:
    """The MTP tensors of a checkpoint, under their checkpoint names."""

    arrays: dict[str, mx.array] = field(default_factory=dict)
    sources: dict[str, Path] = field(default_factory=dict)
    # True when the trunk's weights were in the raw Hugging Face layout (mlx-lm's sanitize
    # then rewrote them); decides the Qwen zero-centred norm convention of the MTP tensors.
    raw_hf_layout: bool = True

    def where(self, key: str) -> str:
        """The file a key came from, for error messages."""
        source = self.sources.get(key)
        return str(source) if source is not None else "the checkpoint"


def load_separate_mtp(
    files: list[Path], is_mtp_key: Callable[[str], bool], into: MTPTensors
) -> None:
    """Add the tensors of separate MTP files to ``into``; every key must be an MTP key."""
    for file in files:
        read_safetensors_header(file)
        arrays = mx.load(str(file))
        if not isinstance(arrays, dict):  # a .safetensors file always loads as a mapping
            raise CheckpointError(f"{file} is not a safetensors weight file")
        for key, value in arrays.items():
            if not is_mtp_key(key):
                raise CheckpointError(f"unexpected key {key!r} in MTP weight file {file}")
            if key in into.arrays:
                raise CheckpointError(f"MTP weight {key!r} appears twice ({file})")
            into.arrays[key] = value
            into.sources[key] = file
