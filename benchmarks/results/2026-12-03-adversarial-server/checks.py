"""The request-level bars against a local server with an API key (loopback only): stop
limits, a partial body counted as 499, HEAD /health, a pydantic ``$defs`` tool schema on
the three APIs, oversized tool parts refused before tokenizing, a stalled body closed.
Prints one JSON object.

    python checks.py --port 8130 --key KEY
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
from typing import Literal

import anthropic
import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["oslo", "rome"]
    main: bool


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    home: Address
    others: list[Address] = Field(max_length=2)


def timed(function, *args, **kwargs):
    start = time.monotonic()
    result = function(*args, **kwargs)
    return result, round(time.monotonic() - start, 3)


def health_watch(url: str, stop: threading.Event, worst: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=10)
        worst.append(time.monotonic() - start)
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--key", required=True)
    p.add_argument("--body-timeout", action="store_true", help="also wait out a stalled body")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    out: dict = {"model": model}
    hi = [{"role": "user", "content": "hi"}]
    client = httpx.Client(base_url=url, headers=headers, timeout=300)

    # 7: stop sequences, with /health watched meanwhile.
    stop, worst = threading.Event(), []
    watcher = threading.Thread(target=health_watch, args=(url, stop, worst))
    watcher.start()
    body = {"model": model, "messages": hi, "max_tokens": 8, "n": 16, "stop": ["ab"] * 1_500_000}
    r, seconds = timed(client.post, "/v1/chat/completions", json=body)
    out["stop_1.5M"] = {"status": r.status_code, "param": r.json()["error"]["param"],
                        "seconds": seconds}  # fmt: skip
    r = client.post("/v1/chat/completions", json={**body, "stop": ["a", "b", "c", "d", "e"]})
    out["stop_5"] = {"status": r.status_code, "message": r.json()["error"]["message"]}
    r = client.post("/v1/chat/completions", json={**body, "n": 1, "stop": ["a", "b", "c", "d"]})
    out["stop_4"] = r.status_code
    r = client.post("/v1/messages", json={"model": model, "max_tokens": 4, "messages": hi,
                                          "stop_sequences": ["s"] * 17})  # fmt: skip
    out["anthropic_stop_17"] = {"status": r.status_code, "message": r.json()["error"]["message"]}

    # 9: oversized tool parts.
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 10_000_000}}
    r, seconds = timed(client.post, "/v1/chat/completions",
                       json={"model": model, "messages": hi, "tools": [tool]})  # fmt: skip
    out["tool_description_10MB"] = {"status": r.status_code, "seconds": seconds,
                                    "param": r.json()["error"]["param"]}  # fmt: skip
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 10**7}}
    messages = [*hi, {"role": "assistant", "content": None, "tool_calls": [call]}]
    r, seconds = timed(client.post, "/v1/chat/completions",
                       json={"model": model, "messages": messages})  # fmt: skip
    out["tool_arguments_10MB"] = {"status": r.status_code, "seconds": seconds,
                                  "param": r.json()["error"]["param"]}  # fmt: skip
    tools = [{"name": f"t{i}", "description": "x" * 200, "input_schema": {"type": "object"}}
             for i in range(2000)]  # fmt: skip
    r, seconds = timed(client.post, "/v1/messages/count_tokens",
                       json={"model": model, "messages": hi, "tools": tools})  # fmt: skip
    out["count_tokens_2000_tools"] = {"status": r.status_code, "seconds": seconds}
    stop.set()
    watcher.join()
    out["health_max_s_during_the_above"] = round(max(worst), 3)

    # 10: HEAD.
    for path in ("/health", "/metrics", "/v1/models"):
        r = client.head(path)
        out[f"HEAD {path}"] = {"status": r.status_code, "body_bytes": len(r.content)}

    # 8: a partial body, then the client leaves.
    with socket.create_connection(("127.0.0.1", args.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            + f"Authorization: Bearer {args.key}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": '
        )
        time.sleep(0.5)
    time.sleep(0.5)
    metrics = client.get("/metrics").text
    out["requests_total_499_500"] = [
        line for line in metrics.splitlines()
        if line.startswith("mtplx_requests_total") and ('"499"' in line or '"500"' in line)
    ]  # fmt: skip

    # 5: a pydantic schema with $defs, tool_choice required, on the three APIs.
    schema = Person.model_json_schema()
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=args.key, max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=url, api_key=args.key, max_retries=0, timeout=300)
    pick = [{"role": "user", "content": "Save a person who lives in Oslo."}]
    valid: dict = {"chat": 0, "responses": 0, "anthropic": 0, "tries_each": 5}
    for _ in range(5):
        chat = oai.chat.completions.create(
            model=model, messages=pick, max_tokens=200, tool_choice="required",
            parallel_tool_calls=False,
            tools=[{"type": "function", "function": {"name": "save", "parameters": schema}}],
        )  # fmt: skip
        arguments = chat.choices[0].message.tool_calls[0].function.arguments
        Person.model_validate_json(arguments)
        valid["chat"] += 1
        response = oai.responses.create(
            model=model, input="Save a person who lives in Oslo.", max_output_tokens=200,
            tool_choice="required", parallel_tool_calls=False,
            tools=[{"type": "function", "name": "save", "parameters": schema}],
        )  # fmt: skip
        Person.model_validate_json(response.output[0].arguments)
        valid["responses"] += 1
        message = claude.messages.create(
            model=model, max_tokens=200, messages=pick,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            tools=[{"name": "save", "input_schema": schema}],
        )  # fmt: skip
        Person.model_validate(message.content[0].input)
        valid["anthropic"] += 1
    out["pydantic_defs_calls"] = valid

    # 4: a stalled authenticated body is closed after body_timeout.
    if args.body_timeout:
        with socket.create_connection(("127.0.0.1", args.port), timeout=120) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                + f"Authorization: Bearer {args.key}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            start = time.monotonic()
            data = sock.recv(4096)
            out["stalled_body"] = {"closed_after_s": round(time.monotonic() - start, 1),
                                   "bytes": len(data)}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
