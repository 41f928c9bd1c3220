"""Greedy outputs with the prefix cache and the cost budget: a long prompt cold, then warm (a
prefix hit) while four streams and three other long prompts run beside it, then with
``mtplx.drafter: none``; all must be the same text.

Usage: python prefix_equal.py PORT"""

import asyncio
import json
import sys

import httpx

URL = f"http://localhost:{sys.argv[1]}/v1/chat/completions"
PROMPT = "Summarise the following list. " + " ".join(f"item{i} is {i * 7 % 13}" for i in range(120))


def body(text: str, extra: dict | None = None, max_tokens: int = 48) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, **({"mtplx": extra} if extra else {})}


async def one(client: httpx.AsyncClient, payload: dict) -> dict:
    r = await client.post(URL, json=payload)
    d = r.json()
    return {"text": d["choices"][0]["message"]["content"],
            "cached": d["usage"]["prompt_tokens_details"]["cached_tokens"]}


async def main() -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        cold = await one(client, body(PROMPT))
        beside = [one(client, body(f"Count to {i}.", max_tokens=64)) for i in range(4)]
        beside += [one(client, body(f"{i} " + "word " * 300, max_tokens=8)) for i in range(3)]
        warm, *_ = await asyncio.gather(one(client, body(PROMPT)), *beside)
        plain = await one(client, body(PROMPT + " ", {"drafter": "none"}))
        plain_same = await one(client, body(PROMPT, {"drafter": "none"}))
    out = {"cold": cold, "warm": warm, "plain_same_prompt": plain_same,
           "warm_equals_cold": warm["text"] == cold["text"],
           "plain_equals_cold": plain_same["text"] == cold["text"]}
    print(json.dumps(out, indent=1))


asyncio.run(main())
