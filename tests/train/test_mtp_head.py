"""The MTP head training program end to end on a tiny fixture checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import load
from mtplx.train import mtp_head
from mtplx.train.head import load_head
from mtplx.train.prompts import build_prompts
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head

LAYER_NAMES = {
    f"mtp.layers.0.{n}.weight"
    for n in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
}
EXPECTED = LAYER_NAMES | {
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.fc.weight",
    "mtp.norm.weight",
    "mtp.lm_head.weight",
    "mtp.draft_vocab",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untie_lm_head(build_checkpoint("llama_no_mtp", tmp_path_factory.mktemp("train_ck")))


def _run(checkpoint: Path, out: Path, *extra: str) -> Path:
    args = [
        "--out", str(out), "--model", str(checkpoint), "--num-prompts", "6", "--rounds", "1",
        "--max-answer-tokens", "16", "--text-tokens", "256", "--gen-batch", "6",
        "--draft-vocab", "64", "--seq-len", "32", "--batch", "4", "--max-steps", "4",
        "--top-k", "8", *extra,
    ]  # fmt: skip
    assert mtp_head.main(args) == 0
    return out / "mtp.safetensors"


def test_trains_and_writes_a_loadable_head(checkpoint: Path, tmp_path: Path) -> None:
    head = _run(checkpoint, tmp_path / "run", "--eval-prompts", "1", "--eval-tokens", "8")
    weights = mx.load(str(head))
    assert set(weights) == EXPECTED
    assert all(v.dtype == mx.float16 for k, v in weights.items() if k != "mtp.draft_vocab")
    assert weights["mtp.draft_vocab"].dtype == mx.int32
    assert weights["mtp.lm_head.weight"].shape[0] == weights["mtp.draft_vocab"].shape[0] == 64
    loaded = load(checkpoint, mtp_weights=head)
    assert len(loaded.mtp_heads) == 1 and loaded.draft_vocab is not None
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["train"]["steps"] == 4
    assert [r["temperature"] for r in report["heldout"]] == [0.0, 0.6]
    assert (tmp_path / "run" / "report.md").is_file()


def test_same_seed_same_weights(checkpoint: Path, tmp_path: Path) -> None:
    first = mx.load(str(_run(checkpoint, tmp_path / "a", "--no-eval")))
    second = mx.load(str(_run(checkpoint, tmp_path / "b", "--no-eval")))
    assert set(first) == set(second)
    for name in first:
        np.testing.assert_array_equal(np.array(first[name]), np.array(second[name]), name)


def test_rerun_reuses_cached_data(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    _run(checkpoint, out, "--no-eval", "--data-only")
    stamp = (out / "data" / "teacher.npz").stat().st_mtime_ns
    _run(checkpoint, out, "--no-eval")
    assert (out / "data" / "teacher.npz").stat().st_mtime_ns == stamp


def test_heldout_prompts_are_disjoint() -> None:
    train, heldout = build_prompts(0)
    assert len(train) >= 300 and len(heldout) >= 20
    assert not {p.topic for p in train} & {p.topic for p in heldout}
    assert {p.kind for p in train} == {"question", "instruction", "code", "summary", "list"}
    assert build_prompts(0) == (train, heldout)


def test_training_prompt_sources() -> None:
    templates = mtp_head.training_prompts("templates", 0, 40)
    assert templates == build_prompts(0, num_train=40)[0]
    broad = mtp_head.training_prompts("broad", 0, 40)
    mix = mtp_head.training_prompts("mix", 0, 40)
    template_kinds = {"question", "instruction", "code", "summary", "list"}
    assert not {p.kind for p in broad} <= template_kinds
    assert all(p.text in {t.text for t in templates} for p in mix[3::4])
    assert [p for i, p in enumerate(mix) if i % 4 != 3] == [
        p for i, p in enumerate(broad) if i % 4 != 3
    ]


def test_init_starts_from_a_head_and_keeps_its_draft_vocabulary(
    checkpoint: Path, tmp_path: Path
) -> None:
    first = _run(checkpoint, tmp_path / "a", "--no-eval")
    # lr 0: the fine-tuned head is the initial head, whatever --draft-vocab says
    again = _run(
        checkpoint, tmp_path / "b", "--no-eval", "--init", str(first), "--lr", "0",
        "--draft-vocab", "32", "--prompt-source", "mix",
    )  # fmt: skip
    a, b = mx.load(str(first)), mx.load(str(again))
    assert set(a) == set(b) == EXPECTED
    for name in a:
        np.testing.assert_array_equal(np.array(a[name]), np.array(b[name]), name)
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["init"] == str(first) and report["draft_vocab_size"] == 64


def test_load_head_rejects_a_foreign_file(checkpoint: Path, tmp_path: Path) -> None:
    model = load(checkpoint, mtp_weights=None)
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), {"mtp.draft_vocab": mx.arange(8), "mtp.x": mx.zeros(2)})
    with pytest.raises(ValueError, match="do not match"):
        load_head(model.target.trunk, bad)
