"""Layer-skip drafts and the target/draft vocabulary check."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import check_same_vocabulary, load, make_layer_skip_draft

TOKENS = mx.array([[257, 72, 101, 108, 108, 111, 258, 10]])


@pytest.fixture(scope="module")
def llama(llama_mtp_checkpoint: Path):
    return load(llama_mtp_checkpoint)


def test_all_layers_equal_the_target(llama) -> None:
    draft = make_layer_skip_draft(llama, 2)
    expected, _ = llama.target(TOKENS, llama.target.make_cache())
    logits, hidden = draft(TOKENS, draft.make_cache())
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-5, rtol=0)
    assert hidden.shape == (1, TOKENS.shape[1], 64)


def test_first_layer_draft_shares_weights_and_has_its_own_cache(llama) -> None:
    draft = make_layer_skip_draft(llama, 1)
    assert draft.vocab_size == llama.target.vocab_size
    assert draft.trunk.inner.layers[0] is llama.target.trunk.inner.layers[0]
    cache = draft.make_cache()
    assert len(cache) == 1
    full, _ = draft(TOKENS, draft.make_cache())
    steps = [draft(TOKENS[:, i : i + 1], cache)[0] for i in range(TOKENS.shape[1])]
    np.testing.assert_allclose(
        np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=1e-4, rtol=0
    )
    target_logits, _ = llama.target(TOKENS, llama.target.make_cache())
    assert not np.allclose(np.array(full), np.array(target_logits))


@pytest.mark.parametrize("layers", [0, 3, -1])
def test_out_of_range(llama, layers: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 2"):
        make_layer_skip_draft(llama, layers)


def test_non_llama_trunk_is_refused(qwen3_next_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="llama-like"):
        make_layer_skip_draft(load(qwen3_next_checkpoint), 1)


def test_same_vocabulary_passes(llama, llama_no_mtp_checkpoint: Path) -> None:
    check_same_vocabulary(llama, load(llama_no_mtp_checkpoint))


def test_vocab_size_mismatch_is_named(llama) -> None:
    other = dataclasses.replace(
        llama, path=Path("/elsewhere"), target=SimpleNamespace(vocab_size=300)
    )
    with pytest.raises(ValueError, match="vocab_size 300"):
        check_same_vocabulary(llama, other)


def test_tokenizer_mismatch_is_named(llama) -> None:
    vocab = dict(llama.tokenizer.get_vocab())
    vocab["<|im_end|>"], vocab["<|im_start|>"] = vocab["<|im_start|>"], vocab["<|im_end|>"]
    other = dataclasses.replace(llama, tokenizer=SimpleNamespace(get_vocab=lambda: vocab))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_same_vocabulary(llama, other)
