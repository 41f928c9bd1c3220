"""Disconnect while a long prompt is still prefilling (before any byte of the reply), beside a
running stream: the batch and the KV gauge must come back to idle, the stream unharmed.

Usage: python cancel_prefill.py PORT"""

import asyncio
import json
import sys

import httpx

BASE = f"http://localhost:{sys.argv[1]}"


def body(text: str, max_tokens: int) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def stream(client: httpx.AsyncClient, payload: dict) -> str:
    async with client.stream("POST", BASE + "/v1/chat/completions", json=payload) as r:
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line
        return last


async def main() -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        idle = (await client.get(BASE + "/health")).json()
        runner = asyncio.create_task(stream(client, body("Tell me a story.", 200)))
        health_during = []
        for k in range(3):
            victim = asyncio.create_task(stream(client, body(f"{k} " + "long " * 3000, 16)))
            await asyncio.sleep(1.0)
            health_during.append((await client.get(BASE + "/health")).json()["batch"])
            victim.cancel()
            try:
                await victim
            except asyncio.CancelledError:
                pass
        last = await runner
        await asyncio.sleep(1.0)
        after = (await client.get(BASE + "/health")).json()
    print(json.dumps({"idle": {"kv": idle["kv"], "requests": idle["requests"]},
                      "batch_while_prefilling": health_during, "runner_last": last,
                      "after": {"kv": after["kv"], "batch": after["batch"],
                                "requests": after["requests"]}}, indent=1))


asyncio.run(main())
