"""Heavy but well-formed requests against a local server with an API key, each sent while
a prober asks /health every 50 ms: how long the request took, its status, and the longest
/health answer meanwhile (what the request cost the event loop and the tokenizer lock).
Prints one JSON object.

    python loop_stall.py --port 8130 --key KEY
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--only", default="")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}", "x-api-key": args.key}
    client = httpx.Client(base_url=url, headers=headers, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]
    alternating = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"}
                   for i in range(60_000)]  # fmt: skip
    largest = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(420_000)
    ]  # fmt: skip (15.3 MB: under the 16 MiB body limit)
    tool = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    cases = {
        "detokenize 1M ids": ("/detokenize", {"tokens": [1] * 1_000_000}),
        "tokenize 131k chars": ("/tokenize", {"prompt": "ab " * 43_000}),
        "chat 60k alternating messages": (
            "/v1/chat/completions",
            {"model": model, "messages": alternating, "max_tokens": 1},
        ),
        "anthropic 60k alternating messages": (
            "/v1/messages",
            {"model": model, "messages": alternating, "max_tokens": 1},
        ),
        "responses 60k input items": (
            "/v1/responses",
            {
                "model": model,
                "max_output_tokens": 16,
                "input": [{"role": "user", "content": "x"}] * 60_000,
            },
        ),
        "count_tokens 60k messages": (
            "/v1/messages/count_tokens",
            {"model": model, "messages": alternating},
        ),
        "chat 420k messages (15 MB)": (
            "/v1/chat/completions",
            {"model": model, "messages": largest, "max_tokens": 1},
        ),
        "anthropic 420k messages (15 MB)": (
            "/v1/messages",
            {"model": model, "messages": largest, "max_tokens": 1},
        ),
        "count_tokens 420k messages (15 MB)": (
            "/v1/messages/count_tokens",
            {"model": model, "messages": largest},
        ),
        "chat 1 message of 420k text parts (15 MB)": (
            "/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 1,
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x"}] * 420_000}
                ],
            },
        ),
        "chat logit_bias 500k keys": (
            "/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 1,
                "messages": alternating[:1],
                "logit_bias": {str(i): 1 for i in range(500_000)},
            },
        ),
        "chat 300 tools x 200 props": (
            "/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 1,
                "messages": alternating[:1],
                "tools": [
                    {"type": "function", "function": {"name": f"t{i}", "parameters": tool}}
                    for i in range(300)
                ],
            },
        ),
        "chat 8k prompt chars x16 (at the char bound)": (
            "/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "\u00e9\u4e2d" * 65_000}],
            },
        ),
    }
    out: dict = {"load_avg": os.getloadavg(), "cases": {}}
    for name, (path, body) in cases.items():
        if args.only and args.only not in name:
            continue
        data = json.dumps(body).encode()
        stop, samples = threading.Event(), []

        def probe(stop: threading.Event = stop, samples: list[float] = samples) -> None:
            while not stop.is_set():
                t = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"{url}/health", timeout=60)
                samples.append(time.monotonic() - t)
                time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        start = time.monotonic()
        try:
            r = client.post(path, content=data, headers={"content-type": "application/json"})
            status, text = r.status_code, r.text[:200]
        except httpx.HTTPError as exc:
            status, text = 0, str(exc)
        seconds = time.monotonic() - start
        stop.set()
        prober.join()
        out["cases"][name] = {"status": status, "seconds": round(seconds, 2),
                              "body_mb": round(len(data) / 1e6, 2),
                              "health_max_s": round(max(samples), 3),
                              "reply": text if status != 200 else ""}  # fmt: skip
        print(name, out["cases"][name], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
