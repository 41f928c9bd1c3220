"""A bounded soak of a running MTPLX server (``make soak``).

For ``--minutes``, waves of mixed requests at rotating concurrency (2, 4, 8, 16): streaming
and whole chat completions, legacy completions with several prompts, ``n`` > 1, logprobs,
stop strings, seeds, and clients that disconnect after a random number of chunks. Every 10
seconds the server's resident memory is sampled (``/proc/PID/status``). The report counts
requests by outcome (finished, error event, HTTP status, disconnected on purpose) and lists
any request that was admitted (200) but ended without a finish or an error event: a lost
request. Loopback only; every loop is bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a haiku about rain.",
    "List five fruits.",
    "Explain recursion to a child.",
    "Repeat this: red, green, blue, red, green, blue.",
    "What is 12 times 13?",
]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _one(client: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """One random request; returns its outcome class."""
    kind = rng.choice(["stream", "stream", "whole", "completions", "n2", "disconnect"])
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    body: dict = {"model": model, "max_tokens": rng.choice([8, 16, 32]), "temperature": 0.7}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1000)
    if kind == "completions":
        body |= {"prompt": [rng.choice(PROMPTS), rng.choice(PROMPTS)], "logprobs": 2}
        response = await client.post("/v1/completions", json=body)
        return "finished" if response.status_code == 200 else f"http {response.status_code}"
    body["messages"] = messages
    if kind == "whole" or kind == "n2":
        body |= {"n": 2} if kind == "n2" else {"logprobs": True, "top_logprobs": 2}
        response = await client.post("/v1/chat/completions", json=body)
        return "finished" if response.status_code == 200 else f"http {response.status_code}"
    body["stream"] = True
    if rng.random() < 0.3:
        body["stop"] = [" blue"]
    cut = rng.randrange(1, 6) if kind == "disconnect" else None
    chunks, finished, errored = 0, False, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return f"http {response.status_code}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            errored |= "error" in chunk
            finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
            chunks += 1
            if cut is not None and chunks >= cut:
                return "disconnected on purpose"
    if errored:
        return "error event"
    return "finished" if finished else "LOST (200 without finish or error)"


async def soak(url: str, pid: int, minutes: float, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    end = started + minutes * 60
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(600):  # the server may still be starting (model conversion, calibration)
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)
        started = time.monotonic()
        end = started + minutes * 60
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def sample_memory() -> None:
            while time.monotonic() < end:
                rss.append((round(time.monotonic() - started), _rss_mib(pid)))
                await asyncio.sleep(10)

        sampler = asyncio.create_task(sample_memory())
        wave = 0
        while time.monotonic() < end:
            concurrency = (2, 4, 8, 16)[wave % 4]
            results = await asyncio.gather(
                *(_one(client, model, rng) for _ in range(concurrency)), return_exceptions=True
            )
            for result in results:
                key = result if isinstance(result, str) else f"client {type(result).__name__}"
                outcomes[key] += 1
            wave += 1
        sampler.cancel()
        health = (await client.get("/health")).json()
    return {
        "minutes": minutes,
        "waves": wave,
        "outcomes": dict(outcomes),
        "rss_mib": rss,
        "health_after": health.get("batch"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args()
    report = asyncio.run(soak(args.url, args.pid, args.minutes, args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    rss = [mib for _, mib in report["rss_mib"]]
    lost = sum(n for k, n in report["outcomes"].items() if k.startswith("LOST"))
    lines = [
        f"# Soak: {report['minutes']} min, {report['waves']} waves",
        "",
        *(f"- {k}: {n}" for k, n in sorted(report["outcomes"].items())),
        f"- lost requests: {lost}",
        f"- server RSS MiB: first {rss[0]:.0f}, max {max(rss):.0f}, last {rss[-1]:.0f}"
        if rss
        else "- no RSS samples",
        f"- batch after: {report['health_after']}",
    ]
    (args.out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
