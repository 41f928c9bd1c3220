"""Reasoning models: the thinking (``<think>...</think>``) apart from the answer in chat
completions (``reasoning_content``), Anthropic Messages (``thinking`` blocks) and Responses
(``reasoning`` items), streamed and not; ``chat_template_kwargs``; constrained replies.

The parser itself is tested on scripted text cut at every place; the APIs on a scripted
engine (byte tokens, so every tag arrives split across tokens) through the official SDKs,
and end to end on a tiny real checkpoint with a Qwen3-style thinking template."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent
from server.errors import APIError
from server.prompts import check_template_kwargs
from server.reasoning import ReasoningSplitter, reasoning_parser
from tests.fake_engine import FakeTokenizer, ScriptedEngine
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.tokenizer import THINK_END_ID, thinking_chat_template
from tests.fixtures.variants import add_thinking_tokens, untie_lm_head

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
THOUGHT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\n"
ANSWER = "The answer is 4."


# ------------------------------------------------------------------------------- parser


def split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    """The reasoning and content of ``text`` fed in pieces cut at ``cuts``."""
    splitter = ReasoningSplitter(opened=opened)
    reasoning = content = ""
    previous = 0
    for cut in [*cuts, len(text)]:
        r, c = splitter.add(text[previous:cut])
        reasoning, content, previous = reasoning + r, content + c, cut
    r, c = splitter.finish()
    return reasoning + r, content + c


SPLITS = {
    # (text, the prompt opened the thinking): (reasoning, content)
    (THOUGHT + ANSWER, False): ("The user wants 2+2. That is 4.", ANSWER),
    ("\n<think>a b</think>c", False): ("a b", "c"),
    ("The user wants 4.\n</think>\n\nFour.", True): ("The user wants 4.", "Four."),
    ("<think>\nmodel opened it anyway</think>x", True): ("model opened it anyway", "x"),
    ("  Hello <think> there", False): ("", "  Hello <think> there"),  # not at the start
    ("plain answer", False): ("", "plain answer"),
    ("<think>\nnever closes  \n", False): ("never closes", ""),
    ("never closes</thi", True): ("never closes</thi", ""),
    ("\n\n<thin", False): ("", "\n\n<thin"),  # a tag never completed
    ("<think></think>", False): ("", ""),
    ("a</think>b</think>c", True): ("a", "b</think>c"),  # one thinking block
    ("a <think> b</think>c", True): ("a <think> b", "c"),
}


@pytest.mark.parametrize(("text", "opened"), list(SPLITS), ids=[repr(t) for t, _ in SPLITS])
def test_splitter_gives_the_same_split_however_the_text_is_cut(text, opened):
    expected = SPLITS[(text, opened)]
    assert split(text, opened, []) == expected
    rng = random.Random(text)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
        assert split(text, opened, cuts) == expected, cuts
    assert split(text, opened, list(range(1, len(text)))) == expected  # one character a piece


class _Templated(FakeTokenizer):
    def __init__(self, template: str) -> None:
        self.chat_template = template


def test_parser_from_the_template_or_by_name():
    thinking = _Templated(thinking_chat_template(opens=False))
    plain = _Templated("{{ messages }}")
    assert reasoning_parser(thinking, "auto").name == "qwen3"
    assert reasoning_parser(plain, "auto") is None
    assert reasoning_parser(thinking, "none") is None
    assert reasoning_parser(plain, "deepseek_r1").name == "deepseek_r1"
    parser = reasoning_parser(plain, "qwen3")
    assert bytes(parser.close_ids) == b"</think>\n\n"  # the byte tokenizer's ids
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser(plain, "granite")


def test_where_a_reply_starts_is_judged_by_the_text_in_front_of_it():
    qwen3 = reasoning_parser(FakeTokenizer(), "qwen3")
    r1 = reasoning_parser(FakeTokenizer(), "deepseek_r1")
    assert qwen3.opens_in("<|assistant|>\n<think>\n")
    assert not qwen3.opens_in("<|assistant|>\n")  # the model may still open it
    assert not qwen3.opens_in("<think>\n\n</think>\n\n")  # thinking off
    assert qwen3.opens_in("<think>\n\n</think>\n\n<think>\nI")  # a prefill opened it again
    assert r1.opens_in("<|assistant|>\n") and r1.opens_in("<think>\n")
    assert not r1.opens_in("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_cannot_set_the_servers_own_arguments():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert check_template_kwargs(None) == {}
    for key in ("tokenize", "chat_template", "add_generation_prompt", "tools"):
        with pytest.raises(APIError) as error:
            check_template_kwargs({key: True})
        assert error.value.param == f"chat_template_kwargs.{key}"


# ----------------------------------------------------------------- scripted engine, SDKs


@pytest.fixture
async def scripted(make_app: Any) -> Any:
    """``scripted(script, opens=False, **settings) -> (engine, httpx client)``."""
    clients: list[httpx.AsyncClient] = []

    def factory(script: str, opens: bool = False, **settings: Any) -> Any:
        engine = ScriptedEngine(script, opens)
        transport = httpx.ASGITransport(app=make_app(engine, **settings))
        client = httpx.AsyncClient(transport=transport, base_url="http://localhost")
        clients.append(client)
        return engine, client

    yield factory
    for client in clients:
        await client.aclose()


def sdk_openai(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://localhost/v1", api_key="none", http_client=client, max_retries=0
    )


def sdk_anthropic(client: httpx.AsyncClient) -> anthropic.AsyncAnthropic:
    """The Anthropic SDK on the same app (it brings its own httpx, httpx2)."""
    transport = httpx2.ASGITransport(app=client._transport.app)  # type: ignore[attr-defined]
    http_client = httpx2.AsyncClient(transport=transport, base_url="http://localhost")
    return anthropic.AsyncAnthropic(
        base_url="http://localhost", api_key="none", http_client=http_client, max_retries=0
    )


USER = [{"role": "user", "content": "What is 2+2?"}]


async def chat_stream(sdk: openai.AsyncOpenAI, **extra: Any) -> tuple[str, str, list[Any]]:
    """(reasoning, content, chunks) of a streamed chat completion."""
    stream = await sdk.chat.completions.create(model=MODEL, messages=USER, stream=True, **extra)
    chunks = [chunk async for chunk in stream]
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content, chunks


@pytest.mark.anyio
@pytest.mark.parametrize("opens", [False, True], ids=["model-opens", "prompt-opens"])
async def test_chat_completions_split_reasoning_content(scripted, opens):
    script = THOUGHT.removeprefix("<think>") if opens else THOUGHT
    _, client = scripted(script + ANSWER, opens)
    sdk = sdk_openai(client)
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=200)
    message = reply.choices[0].message
    assert message.reasoning_content == "The user wants 2+2. That is 4."
    assert message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    # Byte tokens: those from the first after <think> to the one completing </think>.
    thinking_tokens = len("\nThe user wants 2+2. That is 4.\n</think>")
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    usage = {"include_usage": True}
    reasoning, content, chunks = await chat_stream(sdk, max_tokens=200, stream_options=usage)
    assert (reasoning, content) == (message.reasoning_content, ANSWER)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    chunks = chunks[:-1]  # the usage chunk has no choices
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    texts = [(d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas]
    assert not any("<" in text for text in texts)  # no tag, nor part of one
    assert deltas[0].role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.anyio
async def test_a_reply_that_never_closes_its_thinking_is_all_reasoning(scripted):
    _, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_openai(client)
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=20)
    message = reply.choices[0].message
    assert message.reasoning_content == "The user wan"
    assert message.content is None and reply.choices[0].finish_reason == "length"
    reasoning, content, _ = await chat_stream(sdk, max_tokens=20)
    assert (reasoning, content) == ("The user wan", "")


@pytest.mark.anyio
async def test_tool_calls_are_parsed_from_the_answer_not_the_thinking(scripted):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    thought = "<think>\nI could write <tool_call> here, but I will call add.\n</think>\n\n"
    _, client = scripted(thought + call)
    sdk = sdk_openai(client)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER, tools=tools)
    message = reply.choices[0].message
    assert message.reasoning_content == "I could write <tool_call> here, but I will call add."
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 2, "b": 2}
    reasoning, content, chunks = await chat_stream(sdk, tools=tools)
    assert reasoning == message.reasoning_content and content == ""
    calls = [d.tool_calls for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    assert calls[0][0].function.name == "add"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The same on the other APIs, streamed and not.
    claude = sdk_anthropic(client)
    tool = {"name": "add", "input_schema": {"type": "object"}}
    args = {"model": MODEL, "max_tokens": 200, "messages": USER, "tools": [tool]}
    message = await claude.messages.create(**args)
    async with claude.messages.stream(**args) as stream:
        streamed = await stream.get_final_message()
    for reply in (message, streamed):
        assert [b.type for b in reply.content] == ["thinking", "tool_use"]
        assert reply.content[1].input == {"a": 2, "b": 2} and reply.stop_reason == "tool_use"
    function = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    response = await sdk.responses.create(model=MODEL, input="2+2?", tools=[function])
    stream = await sdk.responses.create(model=MODEL, input="2+2?", tools=[function], stream=True)
    final = [event async for event in stream][-1].response
    for reply in (response, final):
        assert [i.type for i in reply.output] == ["reasoning", "function_call"]
        assert json.loads(reply.output[1].arguments) == {"a": 2, "b": 2}


@pytest.mark.anyio
async def test_a_replys_message_can_go_back_into_the_history(scripted):
    """The openai SDK's message, reasoning_content and all, is a valid history message;
    its thinking reaches the template. Streamed with logprobs, every token has one entry."""
    engine, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_openai(client)
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER)
    history = [*USER, reply.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "user", "content": "And 3+3?"})
    again = await sdk.chat.completions.create(model=MODEL, messages=history)
    assert again.choices[0].message.content == ANSWER
    turn = engine.tokenizer.conversations[-1][1]
    assert turn["reasoning_content"] == "The user wants 2+2. That is 4."
    _, _, chunks = await chat_stream(sdk, logprobs=True, stream_options={"include_usage": True})
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == chunks[-1].usage.completion_tokens == len(THOUGHT + ANSWER)


@pytest.mark.anyio
async def test_chat_template_kwargs_reach_the_template(scripted):
    engine, client = scripted(ANSWER)
    sdk = sdk_openai(client)
    extra = {"chat_template_kwargs": {"enable_thinking": False, "custom": 1}}
    reply = await sdk.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    assert engine.tokenizer.renders[-1] == {"enable_thinking": False, "custom": 1}
    assert reply.choices[0].message.content == ANSWER
    assert reply.choices[0].message.reasoning_content is None
    body = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"tokenize": False}}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tokenize"


@pytest.mark.anyio
@pytest.mark.parametrize("template", ["model-opens", "prompt-opens", "always-thinks"])
async def test_a_constrained_reply_does_not_think(scripted, template):
    """With a grammar the template is asked not to think, a thinking block the prompt
    still opens is closed in the prompt, and the reply is all answer."""
    engine, client = scripted('{"answer": 4}', template != "model-opens")
    engine.tokenizer.always = template == "always-thinks"
    body = {"model": MODEL, "messages": USER, "response_format": {"type": "json_object"}}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"answer": 4}', "reasoning_content": None}
    assert engine.tokenizer.renders[-1] == {"enable_thinking": False}
    prompt = bytes(engine.requests[-1].prompt_ids).decode()
    closed = "<think>\n</think>\n\n" if engine.tokenizer.always else "<think>\n\n</think>\n\n"
    assert prompt.endswith(closed)  # by the template, or by the server
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    r = await client.post(CHAT, json=thinking)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"


@pytest.mark.anyio
async def test_reasoning_parser_none_leaves_the_thinking_in_the_text(scripted):
    _, client = scripted(THOUGHT + ANSWER, reasoning_parser="none")
    reply = await sdk_openai(client).chat.completions.create(model=MODEL, messages=USER)
    message = reply.choices[0].message
    assert message.content == THOUGHT + ANSWER
    assert getattr(message, "reasoning_content", None) is None


@pytest.mark.anyio
async def test_anthropic_messages_thinking_blocks(scripted):
    engine, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_anthropic(client)
    message = await sdk.messages.create(model=MODEL, max_tokens=200, messages=USER)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user wants 2+2. That is 4."
    assert message.content[1].text == ANSWER and message.stop_reason == "end_turn"
    async with sdk.messages.stream(model=MODEL, max_tokens=200, messages=USER) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert kinds.count("content_block_start") == 2
    # Thinking on and off is the template's enable_thinking; earlier thinking is dropped.
    history = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "2+2=4", "signature": ""},
                {"type": "text", "text": "4"},
            ],
        },
        {"role": "user", "content": "And 3+3?"},
    ]
    for thinking, enabled in (({"type": "disabled"}, False), ({"type": "enabled"}, True)):
        config = {**thinking, "budget_tokens": 1024} if enabled else thinking
        await sdk.messages.create(model=MODEL, max_tokens=5, messages=history, thinking=config)
        assert engine.tokenizer.renders[-1] == {"enable_thinking": enabled}
    # The earlier thinking goes to the template as the turn's reasoning_content.
    turn = engine.tokenizer.conversations[-1][1]
    assert turn == {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}


@pytest.mark.anyio
async def test_anthropic_reply_cut_while_thinking_has_only_a_thinking_block(scripted):
    _, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_anthropic(client)
    message = await sdk.messages.create(model=MODEL, max_tokens=20, messages=USER)
    assert [b.type for b in message.content] == ["thinking"]
    assert message.stop_reason == "max_tokens"
    async with sdk.messages.stream(model=MODEL, max_tokens=20, messages=USER) as stream:
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


@pytest.mark.anyio
async def test_responses_reasoning_items(scripted):
    _, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_openai(client)
    response = await sdk.responses.create(model=MODEL, input="What is 2+2?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    assert reasoning.content[0].text == "The user wants 2+2. That is 4."
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    stream = await sdk.responses.create(model=MODEL, input="What is 2+2?", stream=True)
    events = [event async for event in stream]
    final = events[-1].response
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in response.output
    ]
    assert final.usage.output_tokens_details == response.usage.output_tokens_details
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in deltas) == reasoning.content[0].text
    assert {e.output_index for e in deltas} == {0}
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in texts) == ANSWER and {e.output_index for e in texts} == {1}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # An earlier reasoning item sent back in the input is accepted (and dropped).
    again = [{"role": "user", "content": "hi"}, reasoning.model_dump(exclude_none=True)]
    again.append({"role": "user", "content": "again"})
    assert (await sdk.responses.create(model=MODEL, input=again)).status == "completed"


@pytest.mark.anyio
async def test_responses_cut_while_thinking(scripted):
    _, client = scripted(THOUGHT + ANSWER)
    sdk = sdk_openai(client)
    response = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=20)
    assert response.status == "incomplete"
    assert [i.type for i in response.output] == ["reasoning"]
    assert response.output[0].status == "incomplete"
    stream = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=20, stream=True)
    final = [event async for event in stream][-1].response
    assert final.status == "incomplete"
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in response.output
    ]


@pytest.mark.anyio
async def test_only_the_text_in_front_of_the_reply_says_whether_it_starts_thinking(scripted):
    """A user quoting a tag does not put the reply inside the thinking; an assistant
    prefill that opens it does."""
    _, client = scripted("see.\n</think>\n\nFour.")
    sdk = sdk_openai(client)
    quoting = [{"role": "user", "content": "What does <think> do?"}]
    reply = await sdk.chat.completions.create(model=MODEL, messages=quoting)
    assert reply.choices[0].message.content == "see.\n</think>\n\nFour."
    assert reply.choices[0].message.reasoning_content is None
    prefill = [*USER, {"role": "assistant", "content": "<think>\nLet me"}]
    message = await sdk_anthropic(client).messages.create(
        model=MODEL, max_tokens=50, messages=prefill
    )
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == [
        ("thinking", "see."),
        ("text", "Four."),
    ]


@pytest.mark.anyio
async def test_thinking_switches_of_messages_responses_and_tokenize(scripted):
    engine, client = scripted(ANSWER)
    renders = engine.tokenizer.renders
    response = await sdk_openai(client).responses.create(
        model=MODEL, input="hi", reasoning={"effort": "none"}
    )
    assert renders[-1] == {"enable_thinking": False} and response.reasoning.effort == "none"
    await sdk_openai(client).responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    assert renders[-1] == {}  # the template's own default
    chat = sdk_openai(client).chat.completions
    await chat.create(model=MODEL, messages=USER, reasoning_effort="minimal")
    assert renders[-1] == {"enable_thinking": False}
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    await chat.create(model=MODEL, messages=USER, reasoning_effort="none", extra_body=on)
    assert renders[-1] == {"enable_thinking": True}  # the template variables win
    # Anthropic refuses thinking with a forced tool call, as Anthropic does.
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": USER,
        "tools": [tool],
        "tool_choice": {"type": "any"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400 and "tool_choice forces tool use" in r.text
    # /tokenize renders the conversation as chat would, template variables included.
    tokenize = {
        "model": MODEL,
        "messages": USER,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    tokens = (await client.post("/tokenize", json=tokenize)).json()["tokens"]
    assert renders[-1] == {"enable_thinking": False}
    assert bytes(tokens).decode().endswith("<think>\n\n</think>\n\n")


# ------------------------------------------------------- a real checkpoint, end to end

GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real engine on a tiny checkpoint with ``<think>`` / ``</think>`` tokens and a
    Qwen3.5-style template (the generation prompt opens the thinking)."""
    from mtplx.engine import Engine
    from mtplx.models import load

    directory: Path = tmp_path_factory.mktemp("tiny-thinking")
    add_thinking_tokens(untie_lm_head(build_checkpoint("llama_mtp", directory)), "prompt")
    return Engine(load(directory))


@pytest.fixture
def real_app(make_app: Any, thinking_engine: Any) -> Any:
    return make_app(thinking_engine, served_model_name=MODEL)


@pytest.fixture
async def real_client(real_app: Any) -> Any:
    transport = httpx.ASGITransport(app=real_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield c


async def raw_reply(app: Any, engine: Any, max_tokens: int, **template: Any) -> str:
    """The greedy reply as the engine writes it, tags and all."""
    ids = engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True, **template)
    request = GenerationRequest([int(t) for t in ids], GREEDY, max_tokens=max_tokens)
    text = ""
    async with app.state.ctx.bridge.submit(request) as ticket:
        async for _, event in ticket:
            assert isinstance(event, TokenEvent | FinishEvent)
            text += event.text
    return text


@pytest.mark.anyio
async def test_real_checkpoint_splits_its_thinking_in_every_api(real_app, real_client):
    engine = real_app.state.ctx.bridge.engine
    raw = await raw_reply(real_app, engine, 16)
    # The prompt opened the thinking; the fixture's greedy reply closes it mid-way.
    thought, closes, answer = raw.partition("</think>")
    assert closes and thought.strip() and answer.strip(), raw
    expected = (thought.strip(), answer.lstrip())

    sdk = sdk_openai(real_client)
    args = {"model": MODEL, "messages": USER, "max_tokens": 16, "temperature": 0}
    message = (await sdk.chat.completions.create(**args)).choices[0].message
    assert (message.reasoning_content, message.content) == expected
    reasoning, content, _ = await chat_stream(sdk, max_tokens=16, temperature=0)
    assert (reasoning, content) == expected

    claude = sdk_anthropic(real_client)
    args = {"model": MODEL, "messages": USER, "max_tokens": 16, "extra_body": {"temperature": 0}}
    reply = await claude.messages.create(**args)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in reply.content] == [
        ("thinking", expected[0]),
        ("text", expected[1]),
    ]
    async with claude.messages.stream(**args) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in reply.content]

    options = {"model": MODEL, "input": USER, "max_output_tokens": 16, "temperature": 0}
    response = await sdk.responses.create(**options)
    assert response.output[0].content[0].text == expected[0]
    assert response.output_text == expected[1]
    stream = await sdk.responses.create(**options, stream=True)
    final = [event async for event in stream][-1].response
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in response.output
    ]


@pytest.mark.anyio
async def test_real_checkpoint_enable_thinking_false_reaches_the_template(real_app, real_client):
    engine = real_app.state.ctx.bridge.engine
    off = {"enable_thinking": False}
    ids = engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True, **off)
    assert ids[-3:-1] == [THINK_END_ID, ids[-1]]  # </think>, then the blank line
    raw = await raw_reply(real_app, engine, 8, **off)
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0}
    data = (await real_client.post(CHAT, json={**body, "chat_template_kwargs": off})).json()
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert data["choices"][0]["message"] == {
        "role": "assistant",
        "content": raw,
        "reasoning_content": None,
    }
    # A constrained reply: the same prompt, thinking off, whatever the request said.
    schema = {"type": "json_object"}
    data = (await real_client.post(CHAT, json={**body, "response_format": schema})).json()
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert data["choices"][0]["message"]["reasoning_content"] is None
