"""Concurrency against a local server with an API key: a burst past ``max_queue`` (every
reply a 200 or a 429 with Retry-After, none lost), waves of streams cancelled after their
first chunk (the batch empties, a chat answers 200 after), and with ``--sigterm`` a SIGTERM
while streams run (each ends with ``[DONE]``; the exit status). Prints one JSON object.

    python lifecycle.py --port 8130 --key KEY --pid SERVER_PID [--sigterm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections import Counter

import httpx


async def burst(client: httpx.AsyncClient, model: str, count: int) -> dict:
    async def one(i: int) -> str:
        try:
            r = await client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 8,
                "messages": [{"role": "user", "content": f"count to {i}"}]})  # fmt: skip
        except httpx.HTTPError as exc:
            return f"error {type(exc).__name__}"
        if r.status_code == 429 and "retry-after" not in r.headers:
            return "429 without Retry-After"
        return str(r.status_code)

    start = time.monotonic()
    statuses = Counter(await asyncio.gather(*(one(i) for i in range(count))))
    return {"requests": count, "statuses": dict(statuses),
            "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


async def cancel_waves(client: httpx.AsyncClient, model: str, waves: int, width: int) -> dict:
    async def one(i: int) -> str:
        body = {"model": model, "max_tokens": 200, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"story {i}"}]}  # fmt: skip
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                async for _ in r.aiter_lines():
                    return "cut"
        except httpx.HTTPError as exc:
            return f"error {type(exc).__name__}"
        return "ended"

    statuses: Counter = Counter()
    for _ in range(waves):
        statuses.update(await asyncio.gather(*(one(i) for i in range(width))))
    start = time.monotonic()
    running = None
    while time.monotonic() - start < 60:
        health = (await client.get("/health")).json()
        running = health["batch"]["running"] + health["batch"]["waiting"]
        if running == 0:
            break
        await asyncio.sleep(0.5)
    hi = [{"role": "user", "content": "hi"}]
    after = await client.post("/v1/chat/completions",
                              json={"model": model, "max_tokens": 4, "messages": hi})  # fmt: skip
    return {"waves": waves, "width": width, "statuses": dict(statuses),
            "batch_empty_after_s": round(time.monotonic() - start, 1), "left_running": running,
            "chat_after": after.status_code}  # fmt: skip


async def sigterm(client: httpx.AsyncClient, model: str, pid: int, streams: int) -> dict:
    async def one(i: int) -> str:
        body = {"model": model, "max_tokens": 4000, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"story {i}"}]}  # fmt: skip
        text = ""
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for chunk in r.aiter_text():
                    text += chunk
        except httpx.HTTPError as exc:
            return f"error {type(exc).__name__}"
        error = "server_shutting_down" in text
        return f"{'[DONE]' if '[DONE]' in text else 'no [DONE]'}{' + error event' if error else ''}"

    tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
    await asyncio.sleep(8)
    start = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    ends = Counter(await asyncio.gather(*tasks))
    while os.path.exists(f"/proc/{pid}") and time.monotonic() - start < 120:
        await asyncio.sleep(0.2)
    return {"streams": streams, "ends": dict(ends),
            "exited_after_s": round(time.monotonic() - start, 1),
            "alive": os.path.exists(f"/proc/{pid}")}  # fmt: skip


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--sigterm", action="store_true")
    args = p.parse_args()
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", limits=limits,
                                 headers={"Authorization": f"Bearer {args.key}"},
                                 timeout=600) as client:  # fmt: skip
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        out: dict = {"load_avg": os.getloadavg()}
        if args.sigterm:
            out["sigterm"] = await sigterm(client, model, args.pid, 6)
        else:
            out["burst_150"] = await burst(client, model, 150)
            out["cancel_waves"] = await cancel_waves(client, model, 3, 40)
            out["metrics"] = [
                line for line in (await client.get("/metrics")).text.splitlines()
                if line.startswith("mtplx_requests_total") and "chat" in line
            ]  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
