"""Reproduce the soak's lone client ReadError: reuse a pooled keep-alive connection just as the
server's keep-alive timeout (5 s) closes it. httpx's default keepalive_expiry is also 5 s, so a
connection idle ~5 s is still "alive" to the client when the server has closed it.

Usage: python keepalive_race.py PORT EXPIRY  (EXPIRY: the client's keepalive_expiry, seconds)"""

import asyncio
import json
import sys

import httpx

URL = f"http://localhost:{sys.argv[1]}"
EXPIRY = float(sys.argv[2])


async def worker(k: int, outcomes: dict[str, int]) -> None:
    limits = httpx.Limits(keepalive_expiry=EXPIRY)
    async with httpx.AsyncClient(base_url=URL, timeout=60, limits=limits) as client:
        for i in range(8):
            idle = 4.99 + 0.0025 * i + 0.0003 * k  # around the server's 5 s keep-alive timeout
            try:
                await client.get("/v1/models")
                await asyncio.sleep(idle)
                r = await client.post("/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1})
                key = f"http {r.status_code}"
            except httpx.HTTPError as error:
                key = f"client {type(error).__name__}"
            outcomes[key] = outcomes.get(key, 0) + 1


async def main() -> None:
    outcomes: dict[str, int] = {}
    await asyncio.gather(*(worker(k, outcomes) for k in range(16)))
    print(json.dumps({"keepalive_expiry": EXPIRY, "outcomes": outcomes}))


asyncio.run(main())
