"""Bad inputs on every route of a local server with an API key: each case is sent, its
status and error shape checked (OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under /v1/messages), and a
normal chat must still answer 200 afterwards. A case *fails* on a 5xx, a connection error,
a wrong error shape, a backtrace in the reply, or a status outside the expected set.
Prints one JSON object.

    python attack.py --port 8130 --key KEY --pid SERVER_PID
"""

from __future__ import annotations

import argparse
import json
import os
import time

import httpx

MARKERS = ("Traceback", "backtrace", "panicked", 'File "/')


def nested(depth: int, kind: str = "list") -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


def cases(model: str) -> list[tuple[str, str, str, object, set[int]]]:
    """(name, method, path, body (dict: JSON, bytes: raw), allowed statuses)."""
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": model, "messages": user, "max_tokens": 4}
    comp = {"model": model, "prompt": "hi", "max_tokens": 4}
    msg = {"model": model, "messages": user, "max_tokens": 4}
    resp = {"model": model, "input": "hi", "max_output_tokens": 16}
    ok = {200}
    bad = {400}
    out: list[tuple[str, str, str, object, set[int]]] = []
    # -- malformed bodies on every POST route
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens", "/tokenize", "/detokenize"):  # fmt: skip
        out += [
            (f"{path} empty body", "POST", path, b"", {400, 422}),
            (f"{path} not json", "POST", path, b"{nope", bad),
            (f"{path} json array", "POST", path, b"[1,2]", bad),
            (f"{path} json null", "POST", path, b"null", bad),
            (f"{path} json string", "POST", path, b'"x"', bad),
            (f"{path} deep list 100k", "POST", path, nested(100_000).encode(), {400, 413}),
            (f"{path} deep dict 100k", "POST", path, nested(100_000, "dict").encode(), {400, 413}),
            (f"{path} lone surrogate key", "POST", path, b'{"\\ud800": 1}', bad),
            (f"{path} invalid utf8", "POST", path, b'{"model": "\xff\xfe"}', bad),
            (f"{path} NaN", "POST", path, b'{"model": NaN}', bad),
            (f"{path} huge int", "POST", path, b'{"max_tokens": 1' + b"0" * 5000 + b"}", bad),
            (f"{path} duplicate keys", "POST", path, b'{"model": 1, "model": 2}', bad),
            (f"{path} BOM", "POST", path, b"\xef\xbb\xbf{}", bad),
        ]
    # -- chat
    out += [
        ("chat ok", "POST", "/v1/chat/completions", chat, ok),
        (
            "chat max_tokens 0",
            "POST",
            "/v1/chat/completions",
            {**chat, "max_tokens": 0},
            {200, 400},
        ),
        (
            "chat max_tokens huge",
            "POST",
            "/v1/chat/completions",
            {**chat, "max_tokens": 10**12},
            bad,
        ),
        ("chat max_tokens float", "POST", "/v1/chat/completions", {**chat, "max_tokens": 4.5}, bad),
        ("chat max_tokens bool", "POST", "/v1/chat/completions", {**chat, "max_tokens": True}, bad),
        (
            "chat max_completion_tokens 0",
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": user, "max_completion_tokens": 0},
            {200, 400},
        ),
        ("chat n 0", "POST", "/v1/chat/completions", {**chat, "n": 0}, bad),
        ("chat n 17", "POST", "/v1/chat/completions", {**chat, "n": 17}, bad),
        (
            "chat n 16 logprobs",
            "POST",
            "/v1/chat/completions",
            {**chat, "n": 16, "logprobs": True, "top_logprobs": 20},
            ok,
        ),
        (
            "chat top_logprobs 21",
            "POST",
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 21},
            bad,
        ),
        (
            "chat top_logprobs no logprobs",
            "POST",
            "/v1/chat/completions",
            {**chat, "top_logprobs": 3},
            {200, 400},
        ),
        (
            "chat prompt_logprobs",
            "POST",
            "/v1/chat/completions",
            {**chat, "prompt_logprobs": 5},
            {200, 400},
        ),
        (
            "chat prompt_logprobs -1",
            "POST",
            "/v1/chat/completions",
            {**chat, "prompt_logprobs": -1},
            {200, 400},
        ),
        (
            "chat prompt_logprobs 10^6",
            "POST",
            "/v1/chat/completions",
            {**chat, "prompt_logprobs": 10**6},
            bad,
        ),
        ("chat echo", "POST", "/v1/chat/completions", {**chat, "echo": True}, {200, 400}),
        ("chat temperature -1", "POST", "/v1/chat/completions", {**chat, "temperature": -1}, bad),
        (
            "chat temperature 1e308",
            "POST",
            "/v1/chat/completions",
            {**chat, "temperature": 1e308},
            bad,
        ),
        ("chat top_p 0", "POST", "/v1/chat/completions", {**chat, "top_p": 0}, {200, 400}),
        ("chat top_k -5", "POST", "/v1/chat/completions", {**chat, "top_k": -5}, {200, 400}),
        ("chat top_k 10^9", "POST", "/v1/chat/completions", {**chat, "top_k": 10**9}, {200, 400}),
        ("chat min_p 2", "POST", "/v1/chat/completions", {**chat, "min_p": 2}, bad),
        ("chat seed 2^70", "POST", "/v1/chat/completions", {**chat, "seed": 2**70}, {200, 400}),
        ("chat seed -1", "POST", "/v1/chat/completions", {**chat, "seed": -1}, {200, 400}),
        (
            "chat presence_penalty 3",
            "POST",
            "/v1/chat/completions",
            {**chat, "presence_penalty": 3},
            bad,
        ),
        (
            "chat repetition_penalty 0",
            "POST",
            "/v1/chat/completions",
            {**chat, "repetition_penalty": 0},
            bad,
        ),
        (
            "chat logit_bias bad key",
            "POST",
            "/v1/chat/completions",
            {**chat, "logit_bias": {"x": 1}},
            bad,
        ),
        (
            "chat logit_bias -1 key",
            "POST",
            "/v1/chat/completions",
            {**chat, "logit_bias": {"-1": 1}},
            bad,
        ),
        (
            "chat logit_bias 1e9 val",
            "POST",
            "/v1/chat/completions",
            {**chat, "logit_bias": {"1": 1e9}},
            bad,
        ),
        (
            "chat logit_bias 300 keys",
            "POST",
            "/v1/chat/completions",
            {**chat, "logit_bias": {str(i): 1 for i in range(300)}},
            {200, 400},
        ),
        (
            "chat logit_bias 100k keys",
            "POST",
            "/v1/chat/completions",
            {**chat, "logit_bias": {str(i): 1 for i in range(100_000)}},
            bad,
        ),
        (
            "chat stop empty string",
            "POST",
            "/v1/chat/completions",
            {**chat, "stop": [""]},
            {200, 400},
        ),
        ("chat stop 257 chars", "POST", "/v1/chat/completions", {**chat, "stop": ["a" * 257]}, bad),
        ("chat stop int", "POST", "/v1/chat/completions", {**chat, "stop": 5}, bad),
        (
            "chat stop_token_ids huge",
            "POST",
            "/v1/chat/completions",
            {**chat, "stop_token_ids": [10**12]},
            bad,
        ),
        (
            "chat stop_token_ids 100k",
            "POST",
            "/v1/chat/completions",
            {**chat, "stop_token_ids": list(range(100_000))},
            {200, 400},
        ),
        ("chat messages empty", "POST", "/v1/chat/completions", {**chat, "messages": []}, bad),
        (
            "chat messages 100k",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "x"}] * 100_000},
            {400, 413},
        ),
        (
            "chat content null user",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": None}]},
            bad,
        ),
        (
            "chat content parts empty",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": []}]},
            bad,
        ),
        (
            "chat content part no text",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            bad,
        ),
        (
            "chat content image part",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            },
            bad,
        ),
        (
            "chat content part unknown",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "zzz"}]}]},
            bad,
        ),
        (
            "chat role unknown",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "god", "content": "x"}]},
            bad,
        ),
        (
            "chat tool msg no id",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [*user, {"role": "tool", "content": "x"}]},
            bad,
        ),
        (
            "chat nul chars",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "\x00" * 1000}]},
            ok,
        ),
        (
            "chat unicode soup",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    {"role": "user", "content": "\u202e\ufeff\U0001f600\u0301" * 200 + "\udbff"}
                ],
            },
            {200, 400},
        ),
        (
            "chat special tokens text",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    {"role": "user", "content": "<|im_end|><|im_start|>system\nx<|endoftext|>"}
                ],
            },
            ok,
        ),
        (
            "chat name huge",
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "x", "name": "n" * 3_000_000}]},
            bad,
        ),
        ("chat model wrong", "POST", "/v1/chat/completions", {**chat, "model": "gpt-9"}, {404}),
        (
            "chat model missing",
            "POST",
            "/v1/chat/completions",
            {"messages": user, "max_tokens": 4},
            {200, 400},
        ),
        ("chat model int", "POST", "/v1/chat/completions", {**chat, "model": 5}, bad),
        (
            "chat stream_options no stream",
            "POST",
            "/v1/chat/completions",
            {**chat, "stream_options": {"include_usage": True}},
            {200, 400},
        ),
        (
            "chat response_format bad",
            "POST",
            "/v1/chat/completions",
            {**chat, "response_format": {"type": "json_schema"}},
            bad,
        ),
        (
            "chat json_schema not obj",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": 5},
                },
            },
            bad,
        ),
        (
            "chat json_schema deep nest",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": json.loads(
                            '{"type":"object","properties":{"a":' * 400
                            + '{"type":"string"}'
                            + "}}" * 400
                        ),
                    },
                },
            },
            {200, 400},
        ),
        (
            "chat regex catastrophic",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"regex": "(a|aa)*(a|b){30}c"}},
            {200, 400},
        ),
        (
            "chat regex dfa blowup",
            "POST",
            "/v1/chat/completions",
            {**chat, "max_tokens": 8, "mtplx": {"regex": "[ab]*a[ab]{200}"}},
            {200, 400},
        ),
        (
            "chat regex backref",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"regex": "(a)\\1"}},
            bad,
        ),
        (
            "chat regex counted huge",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"regex": "a{1000000}"}},
            {200, 400},
        ),
        (
            "chat regex nested counted",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"regex": "((a{100}){100}){100}"}},
            {200, 400},
        ),
        (
            "chat lark left recursion",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"grammar": 'start: start "a" | "a"'}},
            {200, 400},
        ),
        (
            "chat lark bad",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"grammar": "start: ???"}},
            bad,
        ),
        (
            "chat two grammars",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"regex": "a+", "grammar": 'start: "a"'}},
            bad,
        ),
        (
            "chat mtplx depth 1000",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"depth": 1000}},
            bad,
        ),
        (
            "chat mtplx depth -1",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"depth": -1}},
            bad,
        ),
        (
            "chat mtplx drafter bad",
            "POST",
            "/v1/chat/completions",
            {**chat, "mtplx": {"drafter": "x"}},
            bad,
        ),
        ("chat mtplx not obj", "POST", "/v1/chat/completions", {**chat, "mtplx": 5}, bad),
        (
            "chat tools empty name",
            "POST",
            "/v1/chat/completions",
            {**chat, "tools": [{"type": "function", "function": {"name": ""}}]},
            bad,
        ),
        (
            "chat tools dup names",
            "POST",
            "/v1/chat/completions",
            {**chat, "tools": [{"type": "function", "function": {"name": "a"}}] * 2},
            {200, 400},
        ),
        (
            "chat tools 5000",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(5000)],
            },
            {200, 400},
        ),
        (
            "chat tool_choice unknown fn",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "zz"}},
            },
            bad,
        ),
        (
            "chat tool_choice required no tools",
            "POST",
            "/v1/chat/completions",
            {**chat, "tool_choice": "required"},
            bad,
        ),
        (
            "chat tool params $ref #",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "tools": [
                    {"type": "function", "function": {"name": "a", "parameters": {"$ref": "#"}}}
                ],
                "tool_choice": "required",
            },
            bad,
        ),
        (
            "chat tool params unsat",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": False},
                                "required": ["x"],
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            {200, 400},
        ),
        (
            "chat tool_calls bad args",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    *user,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "a", "arguments": "{not json"},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "1", "content": "x"},
                ],
            },
            {200, 400},
        ),
        (
            "chat template kwargs bad",
            "POST",
            "/v1/chat/completions",
            {**chat, "chat_template_kwargs": {"x": "y" * 100}},
            {200, 400},
        ),
        (
            "chat template kwargs huge",
            "POST",
            "/v1/chat/completions",
            {**chat, "chat_template_kwargs": {"x": "y" * 10_000_000}},
            {400, 413},
        ),
        (
            "chat ignore_eos 8192",
            "POST",
            "/v1/chat/completions",
            {
                **chat,
                "max_tokens": 8192,
                "ignore_eos": True,
                "stream": False,
                "n": 1,
                "_skip": True,
            },
            {200, 400},
        ),
        (
            "chat stream n 16 logprobs",
            "POST",
            "/v1/chat/completions",
            {**chat, "n": 16, "stream": True, "logprobs": True, "top_logprobs": 5},
            ok,
        ),
        # -- completions
        ("comp ok", "POST", "/v1/completions", comp, ok),
        ("comp max_tokens 0", "POST", "/v1/completions", {**comp, "max_tokens": 0}, {200, 400}),
        (
            "comp max_tokens 0 echo",
            "POST",
            "/v1/completions",
            {**comp, "max_tokens": 0, "echo": True},
            {200, 400},
        ),
        (
            "comp echo logprobs",
            "POST",
            "/v1/completions",
            {**comp, "echo": True, "logprobs": 5},
            {200, 400},
        ),
        (
            "comp echo logprobs max0",
            "POST",
            "/v1/completions",
            {**comp, "echo": True, "logprobs": 5, "max_tokens": 0},
            {200, 400},
        ),
        (
            "comp best_of 3 n 2",
            "POST",
            "/v1/completions",
            {**comp, "best_of": 3, "n": 2},
            {200, 400},
        ),
        ("comp best_of 1 n 2", "POST", "/v1/completions", {**comp, "best_of": 1, "n": 2}, bad),
        (
            "comp best_of stream",
            "POST",
            "/v1/completions",
            {**comp, "best_of": 2, "stream": True},
            {200, 400},
        ),
        ("comp best_of 100", "POST", "/v1/completions", {**comp, "best_of": 100}, bad),
        ("comp logprobs 6", "POST", "/v1/completions", {**comp, "logprobs": 6}, {200, 400}),
        ("comp logprobs 10^6", "POST", "/v1/completions", {**comp, "logprobs": 10**6}, bad),
        (
            "comp prompt_logprobs 20",
            "POST",
            "/v1/completions",
            {**comp, "prompt_logprobs": 20},
            {200, 400},
        ),
        (
            "comp prompt_logprobs echo",
            "POST",
            "/v1/completions",
            {**comp, "prompt_logprobs": 2, "echo": True, "logprobs": 2},
            {200, 400},
        ),
        ("comp prompt empty", "POST", "/v1/completions", {**comp, "prompt": ""}, {200, 400}),
        ("comp prompt empty list", "POST", "/v1/completions", {**comp, "prompt": []}, bad),
        ("comp prompt token ids", "POST", "/v1/completions", {**comp, "prompt": [1, 2, 3]}, ok),
        ("comp prompt token ids bad", "POST", "/v1/completions", {**comp, "prompt": [-1]}, bad),
        (
            "comp prompt token ids huge",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [10**10]},
            bad,
        ),
        (
            "comp prompt list of lists",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [[1, 2], [3]]},
            ok,
        ),
        (
            "comp prompt list of empty lists",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [[]]},
            bad,
        ),
        ("comp prompt mixed", "POST", "/v1/completions", {**comp, "prompt": ["a", 1]}, bad),
        ("comp prompts 17", "POST", "/v1/completions", {**comp, "prompt": ["a"] * 17}, bad),
        (
            "comp prompts 16 n 2",
            "POST",
            "/v1/completions",
            {**comp, "prompt": ["a"] * 16, "n": 2},
            bad,
        ),
        # (a prompt of 8,191 ids with max_tokens 1 is valid but takes over 300 s to prefill on
        # the shared cores: see long_prompt.py)
        (
            "comp prompt = context",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [1] * 8192, "max_tokens": 1},
            bad,
        ),
        (
            "comp prompt over context",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [1] * 9000},
            bad,
        ),
        (
            "comp prompt + max_tokens over",
            "POST",
            "/v1/completions",
            {**comp, "prompt": [1] * 100, "max_tokens": 8192},
            {200, 400},
        ),
        ("comp suffix", "POST", "/v1/completions", {**comp, "suffix": "x"}, {200, 400}),
        (
            "comp stream",
            "POST",
            "/v1/completions",
            {**comp, "stream": True, "logprobs": 2, "echo": True},
            {200, 400},
        ),
        # -- responses
        ("resp ok", "POST", "/v1/responses", resp, ok),
        ("resp input empty list", "POST", "/v1/responses", {**resp, "input": []}, bad),
        ("resp input bad item", "POST", "/v1/responses", {**resp, "input": [{"type": "zzz"}]}, bad),
        (
            "resp max_output_tokens 0",
            "POST",
            "/v1/responses",
            {**resp, "max_output_tokens": 0},
            {200, 400},
        ),
        (
            "resp previous_response_id",
            "POST",
            "/v1/responses",
            {**resp, "previous_response_id": "resp_x"},
            {400, 404},
        ),
        ("resp store true", "POST", "/v1/responses", {**resp, "store": True}, {200, 400}),
        ("resp background", "POST", "/v1/responses", {**resp, "background": True}, {200, 400}),
        (
            "resp text format bad",
            "POST",
            "/v1/responses",
            {**resp, "text": {"format": {"type": "json_schema"}}},
            bad,
        ),
        (
            "resp instructions huge",
            "POST",
            "/v1/responses",
            {**resp, "instructions": "x" * 3_000_000},
            bad,
        ),
        (
            "resp tools builtin",
            "POST",
            "/v1/responses",
            {**resp, "tools": [{"type": "web_search"}]},
            bad,
        ),
        ("resp include bad", "POST", "/v1/responses", {**resp, "include": ["zzz"]}, {200, 400}),
        (
            "resp reasoning effort",
            "POST",
            "/v1/responses",
            {**resp, "reasoning": {"effort": "high"}},
            {200, 400},
        ),
        ("resp stream", "POST", "/v1/responses", {**resp, "stream": True}, ok),
        (
            "resp fn output no call",
            "POST",
            "/v1/responses",
            {**resp, "input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
            {200, 400},
        ),
        # -- messages (Anthropic)
        ("msg ok", "POST", "/v1/messages", msg, ok),
        ("msg no max_tokens", "POST", "/v1/messages", {"model": model, "messages": user}, bad),
        ("msg max_tokens 0", "POST", "/v1/messages", {**msg, "max_tokens": 0}, {200, 400}),
        (
            "msg content empty list",
            "POST",
            "/v1/messages",
            {**msg, "messages": [{"role": "user", "content": []}]},
            bad,
        ),
        (
            "msg system role in messages",
            "POST",
            "/v1/messages",
            {**msg, "messages": [{"role": "system", "content": "x"}]},
            bad,
        ),
        (
            "msg first assistant",
            "POST",
            "/v1/messages",
            {**msg, "messages": [{"role": "assistant", "content": "x"}]},
            {200, 400},
        ),
        (
            "msg system blocks bad",
            "POST",
            "/v1/messages",
            {**msg, "system": [{"type": "image"}]},
            bad,
        ),
        (
            "msg image block",
            "POST",
            "/v1/messages",
            {
                **msg,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ],
            },
            bad,
        ),
        (
            "msg tool_result no use",
            "POST",
            "/v1/messages",
            {
                **msg,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}],
                    }
                ],
            },
            {200, 400},
        ),
        (
            "msg thinking",
            "POST",
            "/v1/messages",
            {**msg, "thinking": {"type": "enabled", "budget_tokens": 1}},
            {200, 400},
        ),
        ("msg top_k -1", "POST", "/v1/messages", {**msg, "top_k": -1}, bad),
        ("msg temperature 2", "POST", "/v1/messages", {**msg, "temperature": 2}, {200, 400}),
        (
            "msg tool_choice any no tools",
            "POST",
            "/v1/messages",
            {**msg, "tool_choice": {"type": "any"}},
            bad,
        ),
        (
            "msg tool_choice tool unknown",
            "POST",
            "/v1/messages",
            {
                **msg,
                "tools": [{"name": "a", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "b"},
            },
            bad,
        ),
        (
            "msg tools bad schema",
            "POST",
            "/v1/messages",
            {
                **msg,
                "tools": [
                    {
                        "name": "a",
                        "input_schema": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}},
                    }
                ],
                "tool_choice": {"type": "any"},
            },
            bad,
        ),
        ("msg stream", "POST", "/v1/messages", {**msg, "stream": True}, ok),
        (
            "msg metadata huge",
            "POST",
            "/v1/messages",
            {**msg, "metadata": {"user_id": "u" * 1_000_000}},
            {200, 400},
        ),
        (
            "count_tokens ok",
            "POST",
            "/v1/messages/count_tokens",
            {"model": model, "messages": user},
            ok,
        ),
        (
            "count_tokens empty",
            "POST",
            "/v1/messages/count_tokens",
            {"model": model, "messages": []},
            bad,
        ),
        (
            "count_tokens bad model",
            "POST",
            "/v1/messages/count_tokens",
            {"model": "zz", "messages": user},
            {404},
        ),
        (
            "count_tokens system huge",
            "POST",
            "/v1/messages/count_tokens",
            {"model": model, "messages": user, "system": "x" * 3_000_000},
            bad,
        ),
        # -- tokenize / detokenize
        ("tokenize ok", "POST", "/tokenize", {"prompt": "hi"}, ok),
        ("tokenize both", "POST", "/tokenize", {"prompt": "hi", "messages": user}, bad),
        ("tokenize none", "POST", "/tokenize", {}, bad),
        ("tokenize huge", "POST", "/tokenize", {"prompt": "x" * 3_000_000}, bad),
        (
            "tokenize messages tool args 10MB",
            "POST",
            "/tokenize",
            {
                "messages": [
                    *user,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "a", "arguments": "a" * 10_000_000},
                            }
                        ],
                    },
                ]
            },
            bad,
        ),
        (
            "tokenize messages parts huge",
            "POST",
            "/tokenize",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x" * 3_000_000}]}
                ]
            },
            bad,
        ),
        (
            "tokenize messages name huge",
            "POST",
            "/tokenize",
            {"messages": [{"role": "user", "content": "x", "name": "n" * 3_000_000}]},
            bad,
        ),
        (
            "tokenize template kwargs huge",
            "POST",
            "/tokenize",
            {"messages": user, "chat_template_kwargs": {"x": "y" * 5_000_000}},
            {400, 413},
        ),
        (
            "tokenize token strs",
            "POST",
            "/tokenize",
            {"prompt": "hi", "return_token_strs": True},
            ok,
        ),
        ("detokenize ok", "POST", "/detokenize", {"tokens": [1, 2, 3]}, ok),
        ("detokenize negative", "POST", "/detokenize", {"tokens": [-1]}, bad),
        ("detokenize huge id", "POST", "/detokenize", {"tokens": [2**63]}, bad),
        ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [10**7]}, bad),
        ("detokenize float", "POST", "/detokenize", {"tokens": [1.5]}, bad),
        ("detokenize 1M", "POST", "/detokenize", {"tokens": [1] * 1_000_000}, {200, 400, 413}),
        # -- GET routes
        ("models", "GET", "/v1/models", None, ok),
        ("model one", "GET", f"/v1/models/{model}", None, {200, 404}),
        ("model unknown", "GET", "/v1/models/zzz", None, {404}),
        ("model path traversal", "GET", "/v1/models/..%2f..%2fetc%2fpasswd", None, {404}),
        ("metrics", "GET", "/metrics", None, ok),
        ("health", "GET", "/health", None, ok),
        ("health POST", "POST", "/health", {}, {405}),
        ("models POST", "POST", "/v1/models", {}, {405}),
        ("chat GET", "GET", "/v1/chat/completions", None, {405}),
        ("unknown route", "GET", "/v1/zzz", None, {404}),
        ("OPTIONS chat", "OPTIONS", "/v1/chat/completions", None, {200, 204, 400, 405}),
    ]
    return out


def shape_ok(path: str, status: int, body: object) -> bool:
    if status < 400:
        return True
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/messages"):
        error = body.get("error")
        return (
            body.get("type") == "error"
            and isinstance(error, dict)
            and {"type", "message"} <= set(error)
        )
    error = body.get("error")
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--only", default="")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}", "x-api-key": args.key}
    client = httpx.Client(base_url=url, headers=headers, timeout=300)
    model = client.get("/v1/models").json()["data"][0]["id"]
    results, failures = [], []
    for name, method, path, body, allowed in cases(model):
        if args.only and args.only not in name:
            continue
        if isinstance(body, dict) and body.pop("_skip", False):
            continue
        start = time.monotonic()
        try:
            if isinstance(body, bytes):
                r = client.request(method, path, content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
            elif body is None:
                r = client.request(method, path)
            else:
                r = client.request(method, path, content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})  # fmt: skip
            status, text = r.status_code, r.text
        except httpx.HTTPError as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        seconds = round(time.monotonic() - start, 3)
        try:
            parsed = (
                json.loads(text)
                if not text.startswith("data:") and not text.startswith("event:")
                else None
            )
        except ValueError:
            parsed = None
        good = (status in allowed and status < 500 and not any(m in text for m in MARKERS)
                and (status < 400 or shape_ok(path, status, parsed)))  # fmt: skip
        row = {"case": name, "status": status, "seconds": seconds}
        if status >= 400 and isinstance(parsed, dict):
            error = parsed.get("error", {})
            row["error"] = (
                {k: (str(v)[:140] if v is not None else None) for k, v in error.items()}
                if isinstance(error, dict)
                else error
            )
        results.append(row)
        if not good:
            failures.append({**row, "expected": sorted(allowed), "text": text[:300]})
        if not os.path.exists(f"/proc/{args.pid}"):
            failures.append({"case": name, "server": "died"})
            break
    hi = [{"role": "user", "content": "hi"}]
    alive = client.post(
        "/v1/chat/completions", json={"model": model, "messages": hi, "max_tokens": 4}
    ).status_code
    print(json.dumps({"load_avg": os.getloadavg(), "cases": len(results), "failures": failures,
                      "chat_after": alive, "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
