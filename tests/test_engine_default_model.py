"""Greedy speculative decoding equals plain decoding on the shipped default model
(SmolLM2-135M-Instruct, converted from its GGUF), with OpenBLAS doing the matmuls."""

from __future__ import annotations

import pytest

from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent
from tests.test_engine import run_concurrently

GREEDY = SamplerConfig(temperature=0.0)
DRAFT_LAYERS = 8
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Repeat exactly: the cat sat on the mat, and the dog sat on the log.",
    "Explain why the sky is blue in two sentences.",
    "List three tips for a good night's sleep.",
    "Summarise: Water boils at 100 degrees Celsius at sea level; at altitude it boils lower.",
    "Translate 'good morning' into French and Spanish.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Give a one-line definition of entropy.",
    "Name the planets of the solar system.",
    "How do I open a file in Python and read its lines?",
    "What does HTTP stand for?",
    "Write a short email declining a meeting politely.",
    "Describe a cat to someone who has never seen one.",
    "What are prime numbers?",
    "Write a SQL query selecting all users older than 30.",
    "Why do leaves change colour in autumn?",
    "Tell me a fun fact about octopuses.",
    "Repeat this list: apples, pears, plums, apples, pears, plums.",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    model = load(ensure_default_model())
    return Engine(model, draft_model=make_layer_skip_draft(model, DRAFT_LAYERS))


def _prompt_ids(engine: Engine, text: str) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )


def _tokens(engine: Engine, request: GenerationRequest) -> list[int]:
    return [e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent)]


def _assert_greedy_equal(
    engine: Engine, prompts: list[str], num_tokens: int, depths, together: bool = False
) -> None:
    """Every drafter at every depth emits plain greedy decoding's tokens (plain decoding
    alone is the reference). With ``together``, the whole cross product runs
    ``engine.max_num_seqs`` requests at a time, and prompt i also runs alone with drafter
    i % len(drafters) at depth depths[i % len(depths)] (with 20 prompts and 5 drafters, every
    (drafter, depth) pair runs alone once)."""
    names = ("mtp", "draft_model", "ngram", "mtp+ngram", "draft_model+ngram")
    drafters = [d for d in names if d in engine.available_drafters]
    ids = [_prompt_ids(engine, text) for text in prompts]
    plain = [_tokens(engine, GenerationRequest(p, GREEDY, num_tokens, drafter="none")) for p in ids]
    cases = [
        (drafter, depth, index)
        for index in range(len(ids))
        for drafter in drafters
        for depth in depths
    ]
    if together:
        alone = {
            (drafters[index % len(drafters)], depths[index % len(depths)], index)
            for index in range(len(ids))
        }
    else:
        alone = set(cases)
    requests = [
        GenerationRequest(ids[index], GREEDY, num_tokens, drafter=drafter, depth=depth)
        for drafter, depth, index in cases
    ]
    for case, request in zip(cases, requests, strict=True):
        if case in alone:
            assert _tokens(engine, request) == plain[case[2]], case
    if together:
        for case, tokens in zip(cases, run_concurrently(engine, requests), strict=True):
            assert list(tokens) == plain[case[2]], case


def test_default_model_greedy_speculative_equals_plain(engine: Engine) -> None:
    _assert_greedy_equal(engine, CHAT_PROMPTS[:2], num_tokens=24, depths=(3,))


@pytest.mark.slow
def test_default_model_greedy_speculative_equals_plain_full(engine: Engine) -> None:
    _assert_greedy_equal(engine, CHAT_PROMPTS, 128, depths=(1, 2, 3, 4), together=True)
