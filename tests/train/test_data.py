"""Teacher data captured while generating equals a separate teacher pass; greedy answers equal
plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mtplx.models import load
from mtplx.models.base import LoadedModel
from mtplx.train.data import (
    Sequences,
    _choose,
    chat_prompt_ids,
    entry_is_greedy,
    generate_with_teacher,
    teacher_pass,
)
from mtplx.train.prompts import build_prompts
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = untie_lm_head(build_checkpoint("llama_no_mtp", tmp_path_factory.mktemp("data_ck")))
    return load(path, mtp_weights=None)


def _plain_greedy(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = []
    sampler = make_sampler(temp=0.0)
    for token, _ in generate_step(
        mx.array(prompt), model.target.trunk.model, max_tokens=max_tokens, sampler=sampler
    ):
        tokens.append(int(token))
        if int(token) in model.eos_token_ids:
            break
    return tokens


def test_captured_teacher_equals_a_teacher_pass(model: LoadedModel) -> None:
    prompts, _ = build_prompts(0)
    whole = generate_with_teacher(
        model, prompts[:5], seed=0, rounds=2, max_tokens=24, batch_size=4, top_k=8,
        prompt_context=10_000,
    )  # fmt: skip
    assert len(whole.seqs) == 10
    seqs = Sequences.build(whole.seqs, [0] * 10, whole.starts)
    reference = teacher_pass(model, seqs, top_k=8)
    hidden = np.concatenate(whole.hidden).astype(np.float32)
    np.testing.assert_allclose(hidden, reference.hidden.astype(np.float32), atol=0.02)
    ids, probs = np.concatenate(whole.top_ids), np.concatenate(whole.top_probs)
    best = ids[np.arange(len(ids)), probs.argmax(1)]
    ref_best = reference.top_ids[np.arange(len(ids)), reference.top_probs.argmax(1)]
    assert np.mean(best == ref_best) > 0.97
    np.testing.assert_allclose(
        np.sort(probs, 1), np.sort(reference.top_probs.astype(np.float32), 1), atol=1e-2
    )

    tail = generate_with_teacher(
        model, prompts[:5], seed=0, rounds=2, max_tokens=24, batch_size=4, top_k=8,
        prompt_context=6,
    )  # fmt: skip
    for j in range(10):  # the same rows, cut to the last 6 prompt tokens
        cut = whole.starts[j] - 6
        assert tail.starts[j] == 6 and tail.seqs[j] == whole.seqs[j][cut:]
        np.testing.assert_array_equal(tail.hidden[j], whole.hidden[j][cut:])


def test_greedy_rows_equal_plain_greedy_decoding(model: LoadedModel) -> None:
    prompts, _ = build_prompts(0)
    generated = generate_with_teacher(
        model, prompts[:4], seed=0, rounds=1, max_tokens=20, batch_size=4, top_k=8
    )
    from mtplx.train.data import chat_prompt_ids

    for j, i in enumerate((0, 2)):  # entries (i, 0) with i even are greedy
        row = 0 if i == 0 else 2
        prompt = chat_prompt_ids(model.tokenizer, prompts[i].text)
        answer = generated.seqs[row][generated.starts[row] :]
        expected = _plain_greedy(model, prompt, 20)
        assert answer == expected[: len(answer)] and len(answer) == len(expected) - 1, j


def test_choose_samples_the_tempered_nucleus() -> None:
    ids = np.array([[5, 7, 9, 11]] * 20000)
    probs = np.array([[0.1, 0.6, 0.25, 0.05]] * 20000)
    greedy = np.zeros(20000, bool)
    greedy[:10] = True
    rng = np.random.default_rng(0)
    picked = _choose(ids, probs, greedy, temperature=0.7, top_p=0.9, rng=rng)
    assert (picked[:10] == 7).all()
    tempered = np.array([0.6, 0.25, 0.1, 0.05]) ** (1 / 0.7)
    tempered /= tempered.sum()
    # nucleus 0.9: keeps tokens whose preceding mass is < 0.9 (the 4th one starts at > 0.9)
    keep = np.cumsum(tempered) - tempered < 0.9
    expected = np.where(keep, tempered, 0) / tempered[keep].sum()
    counts = np.array([(picked[10:] == t).mean() for t in (7, 9, 5, 11)])
    np.testing.assert_allclose(counts, expected, atol=0.01)


def test_generation_resumes_at_a_batch_as_one_run_gives(model: LoadedModel) -> None:
    prompts, _ = build_prompts(0)
    per_batch: dict[int, list[list[int]]] = {}
    settings = dict(seed=0, rounds=2, max_tokens=12, batch_size=3, top_k=8, temperature=1.0)
    whole = generate_with_teacher(
        model, prompts[:4], on_batch=lambda b, d: per_batch.__setitem__(b, d.seqs), **settings
    )
    assert sorted(per_batch) == [0, 1, 2]
    resumed = generate_with_teacher(model, prompts[:4], first_batch=1, **settings)
    assert resumed.seqs == per_batch[1] + per_batch[2]
    assert whole.seqs == per_batch[0] + resumed.seqs
    assert len({tuple(s) for s in whole.seqs}) > 4  # sampled rows differ from greedy ones


def test_rounds_after_the_second_are_sampled_not_repeated_greedy() -> None:
    # each prompt gets exactly one greedy answer however many rounds run
    for i in range(6):
        assert [entry_is_greedy(i, r) for r in range(5)].count(True) == 1
    assert entry_is_greedy(0, 0) and entry_is_greedy(1, 1)
    assert not entry_is_greedy(0, 2) and not entry_is_greedy(1, 3)


def test_a_third_round_adds_no_duplicate_greedy_answer(model: LoadedModel) -> None:
    prompts, _ = build_prompts(0)
    generated = generate_with_teacher(
        model, prompts[:2], seed=0, rounds=4, max_tokens=12, batch_size=8, top_k=8,
        temperature=1.0,
    )  # fmt: skip
    assert len(generated.seqs) == 8
    assert len({tuple(s) for s in generated.seqs}) == 8


def test_chat_prompt_ids_put_earlier_turns_first() -> None:
    class Recorder:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # type: ignore[no-untyped-def]
            self.messages = messages
            return [1, 2, 3]

    tokenizer = Recorder()
    history = (("user", "hi"), ("assistant", "hello"))
    assert chat_prompt_ids(tokenizer, "and then?", history) == [1, 2, 3]
    assert tokenizer.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and then?"},
    ]
    chat_prompt_ids(tokenizer, "alone")
    assert tokenizer.messages == [{"role": "user", "content": "alone"}]
