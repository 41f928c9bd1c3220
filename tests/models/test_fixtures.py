"""The checkpoint fixtures are deterministic: same kind and seed, same bytes."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.checkpoints import build_checkpoint


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    first = build_checkpoint("llama_mtp", tmp_path / "a", seed=3)
    second = build_checkpoint("llama_mtp", tmp_path / "b", seed=3)
    for name in ("model.safetensors", "mtp.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = build_checkpoint("llama_mtp", tmp_path / "c", seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
