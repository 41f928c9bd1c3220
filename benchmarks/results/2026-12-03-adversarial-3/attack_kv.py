"""Attack KV admission on a live server: concurrent short streams beside long prompts, a
prompt over --max-kv-bytes, a cancellation mid-prefill; samples /health's batch and kv.

Usage: python attack_kv.py PORT  (server started with --max-kv-bytes 20000000)"""

import asyncio
import json
import sys
import time

import httpx

URL = f"http://localhost:{sys.argv[1]}"
MODEL = "SmolLM2-135M-Instruct"


def body(text: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def stream(client: httpx.AsyncClient, text: str, max_tokens: int, out: dict, key: str,
                 cancel_after: float | None = None) -> None:
    start = time.monotonic()
    gaps, last, ended = [], None, None
    try:
        async with client.stream("POST", URL + "/v1/chat/completions",
                                 json=body(text, max_tokens, True)) as r:
            if r.status_code != 200:
                out[key] = {"status": r.status_code, "body": (await r.aread()).decode()[:300]}
                return
            async for line in r.aiter_lines():
                now = time.monotonic()
                if cancel_after is not None and now - start > cancel_after:
                    out[key] = {"cancelled_at": round(now - start, 2)}
                    return
                if line.startswith("data: "):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if line == "data: [DONE]":
                        ended = "done"
        out[key] = {"status": 200, "ended": ended, "max_gap_s": round(max(gaps or [0]), 2),
                    "total_s": round(time.monotonic() - start, 2)}
    except Exception as error:  # noqa: BLE001
        out[key] = {"error": repr(error)}


async def sample(client: httpx.AsyncClient, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        h = (await client.get(URL + "/health")).json()
        samples.append({"t": round(time.monotonic(), 2), "running": h["batch"]["running"],
                        "waiting": h["batch"]["waiting"], "kv": h["kv"]["bytes"]})
        await asyncio.sleep(0.25)


async def main() -> None:
    out: dict = {}
    samples: list = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        idle0 = (await client.get(URL + "/health")).json()["kv"]
        sampler = asyncio.create_task(sample(client, samples, stop))
        jobs = [stream(client, f"Count to {i}.", 48, out, f"short{i}") for i in range(4)]
        jobs += [stream(client, f"{i} " + "word " * 350, 16, out, f"long{i}") for i in range(4)]
        jobs += [stream(client, "x " * 900, 8, out, "over_bound")]
        jobs += [stream(client, "cancel " * 380, 64, out, "cancel_mid", cancel_after=0.05)]
        await asyncio.gather(*jobs)
        await asyncio.sleep(1.0)
        stop.set()
        await sampler
        out["kv_idle_before"] = idle0
        out["kv_idle_after"] = (await client.get(URL + "/health")).json()["kv"]
        out["max_running"] = max(s["running"] for s in samples)
        out["samples"] = samples
    print(json.dumps(out, indent=1))


asyncio.run(main())
