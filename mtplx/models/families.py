"""Which architecture a config is, where its MTP weights live, and how far we trust its heads.

MTP layouts:

- ``nextn``: the Qwen3-Next form, ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
  layers.N, norm}`` (optionally behind a ``model.`` / ``language_model.`` prefix or in a
  separate ``mtp*.safetensors``). Native to qwen3_next / qwen3_5; the generic head puts the
  same names over any other mlx-lm trunk.
- ``deepseek_v3``: ``model.layers.{num_hidden_layers + i}.*`` (enorm, hnorm, eh_proj,
  shared_head, the decoder block).
- ``deepseek_v4``: ``mtp.{i}.*`` (e_proj, h_proj, enorm, hnorm, norm, hc_head_*, the block).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum
from typing import Any

from mtplx.models.checkpoint import text_config


class Tier(str, Enum):
    """How far a checkpoint's MTP heads are trusted."""

    VERIFIED = "verified"
    UNVERIFIED = "arch-compatible-unverified"
    NO_MTP = "no-MTP"
    UNSUPPORTED = "unsupported"


EXIT_CODES = {Tier.VERIFIED: 0, Tier.UNVERIFIED: 10, Tier.NO_MTP: 11, Tier.UNSUPPORTED: 12}
EXIT_ERROR = 2

# Families whose native MTP head was checked against a reference implementation.
NATIVE_NEXTN = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
VERIFIED_NATIVE = {"qwen3_next", "qwen3_5", "deepseek_v3"}
# Trunks whose forward is embed -> layer(h, mask, cache)... -> norm -> lm_head, with plain
# attention layers: the generic head is verified over them and the layer-skip draft works.
LLAMA_LIKE = {"llama", "qwen2", "qwen3", "qwen3_moe"}

_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def arch_of(config: dict[str, Any]) -> str | None:
    """The mlx-lm module that implements the config (after mlx-lm's remapping), or None."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, _ = _get_classes(config)
    except (ValueError, KeyError):
        return None
    return model_cls.__module__.rsplit(".", 1)[-1]


def mtp_layout(arch: str | None) -> str:
    """The MTP weight layout of an mlx-lm architecture."""
    if arch == "deepseek_v3":
        return "deepseek_v3"
    if arch == "deepseek_v41":
        return "deepseek_v4"
    return "nextn"


def strip_nextn_prefix(key: str) -> str | None:
    """``mtp.<rest>`` for a Qwen3-Next-form MTP key (any known prefix removed), else None."""
    if key.startswith("mtp."):
        return key
    for prefix in _PREFIXES:
        if key.startswith(prefix) and key[len(prefix) :].startswith("mtp."):
            return key[len(prefix) :]
    return None


def mtp_key_predicate(config: dict[str, Any], arch: str | None) -> Callable[[str], bool]:
    """Which checkpoint keys belong to the MTP heads of this architecture."""
    layout = mtp_layout(arch)
    if layout == "deepseek_v3":
        first = int(text_config(config)["num_hidden_layers"])

        def is_deepseek_v3(key: str) -> bool:
            match = _LAYER_KEY.match(key)
            return match is not None and int(match.group(1)) >= first

        return is_deepseek_v3
    if layout == "deepseek_v4":
        return lambda key: key.startswith("mtp.")
    return lambda key: strip_nextn_prefix(key) is not None


def count_mtp_layers(keys: list[str], config: dict[str, Any], arch: str | None) -> int:
    """How many MTP modules (heads) the keys hold."""
    layout = mtp_layout(arch)
    is_mtp = mtp_key_predicate(config, arch)
    found: set[int] = set()
    for key in filter(is_mtp, keys):
        if layout == "deepseek_v3":
            match = _LAYER_KEY.match(key)
        elif layout == "deepseek_v4":
            match = re.match(r"^mtp\.(\d+)\.", key)
        else:
            match = re.match(r"^mtp\.layers\.(\d+)\.", strip_nextn_prefix(key) or "")
        if match is not None:
            found.add(int(match.group(1)))
    return len(found)


def mtp_tier(arch: str | None, has_mtp: bool) -> Tier:
    """The compatibility tier of an architecture with (or without) MTP weights."""
    if arch is None:
        return Tier.UNSUPPORTED
    if not has_mtp:
        return Tier.NO_MTP
    if arch in VERIFIED_NATIVE or arch in LLAMA_LIKE:
        return Tier.VERIFIED
    return Tier.UNVERIFIED
