"""``mtplx bench-serve``: load test of a running server with httpx async streaming clients.

At each concurrency level c, c clients each send requests back to back (the level's
``requests`` spread over them) as streaming chat completions, and the level reports
aggregate completion tokens/s (usage tokens over the level's wall time), time to first
content chunk and request latency (p50 / p99), and errors. Needs only httpx.

The HTTP path's share: each reply's ``"mtplx"`` block says how long the engine worked on it
(prefill + draft + verify seconds); ``http_efficiency`` is that engine time over the client's
latency, summed over a level's requests, i.e. streamed tokens/s over the engine's own tokens/s
for the same requests (at concurrency 1; above it latency includes queueing).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mtplx.bench.prompts import DEFAULT_PROMPT_DIR, load_prompts


@dataclass
class RequestResult:
    """One streamed request: seconds to first content, to the last content and to the end,
    tokens, the text, the reply's ``"mtplx"`` block, error."""

    ttft: float = math.nan
    last_content: float = math.nan
    latency: float = math.nan
    tokens: int = 0
    engine_s: float = math.nan  # the engine's prefill + draft + verify seconds
    text: str = ""
    mtplx: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the seconds after the first content (NaN: too few)."""
        seconds = self.last_content - self.ttft
        return (self.tokens - 1) / seconds if self.tokens > 1 and seconds > 0 else math.nan


@dataclass
class LevelResult:
    """One concurrency level's aggregate."""

    concurrency: int
    requests: int
    errors: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    engine_tokens_per_s: float = math.nan
    http_efficiency: float = math.nan
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile q in [0, 100] (NaN for no values)."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    position = (len(data) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """POST one streaming chat completion and time it; errors are recorded, not raised."""
    result = RequestResult()
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {response.status_code}: {text}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices", []):
                    if content := choice.get("delta", {}).get("content"):
                        result.last_content = time.perf_counter() - started
                        if math.isnan(result.ttft):
                            result.ttft = result.last_content
                        result.text += content
                if chunk.get("usage"):
                    result.tokens = int(chunk["usage"].get("completion_tokens", 0))
                engine = chunk.get("mtplx") or {}
                if "verify_s" in engine:
                    result.engine_s = sum(engine[k] for k in ("prefill_s", "draft_s", "verify_s"))
                    result.mtplx = engine
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.latency = time.perf_counter() - started
    return result


async def run_level(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int, requests: int
) -> LevelResult:
    """``requests`` requests through ``concurrency`` workers (bodies taken round-robin)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(bodies[i % len(bodies)])
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await stream_one(client, queue.get_nowait()))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    engine_s = sum(r.engine_s for r in ok)  # nan when a reply lacked the mtplx block
    latency_s = sum(r.latency for r in ok)
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50=percentile([r.ttft for r in ok], 50),
        ttft_p99=percentile([r.ttft for r in ok], 99),
        latency_p50=percentile([r.latency for r in ok], 50),
        latency_p99=percentile([r.latency for r in ok], 99),
        engine_tokens_per_s=tokens / engine_s if engine_s > 0 else math.nan,
        http_efficiency=engine_s / latency_s if latency_s > 0 else math.nan,
        error_samples=[r.error for r in results if r.error][:3],
    )


async def bench_serve(
    base_url: str,
    *,
    concurrency: list[int],
    requests_per_level: int | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    prompt_dir: Path = DEFAULT_PROMPT_DIR,
) -> list[LevelResult]:
    """Every concurrency level in turn against the server at ``base_url``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, transport=transport
    ) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        bodies = [
            {
                "model": model,
                "messages": [{"role": "user", "content": p.text}],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            for p in load_prompts(prompt_dir)
        ]
        return [
            await run_level(client, bodies, c, requests_per_level or max(c, 4)) for c in concurrency
        ]


@dataclass
class AdmissionResult:
    """Running streams' inter-token gaps while a long prompt joins the batch."""

    streams: int
    prompt_words: int
    long_ttft_s: float
    max_gap_s: float  # the longest wait between two content chunks of a running stream
    max_gap_before_s: float  # the same over the seconds before the long prompt arrived
    gaps_over_2s: int


async def _timed_stream(
    client: httpx.AsyncClient, body: dict[str, Any], stamps: list[float]
) -> None:
    """Stream ``body``, appending the arrival time of every content chunk to ``stamps``."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                stamps.append(time.perf_counter())


async def admission_gaps(
    client: httpx.AsyncClient,
    model: str,
    streams: int,
    prompt_tokens: int,
    max_tokens: int = 400,
    settle_s: float = 3.0,
) -> AdmissionResult:
    """Start ``streams`` long streams; once all are streaming (and ``settle_s`` more), send
    one request whose prompt is about ``prompt_tokens`` tokens and record how long the
    running streams wait between chunks while it is prefilled and starts."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Count from {i} to 1000, one per line."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        for i in range(streams)
    ]
    pairs = zip(bodies, stamps, strict=True)
    tasks = [asyncio.create_task(_timed_stream(client, b, s)) for b, s in pairs]
    while not all(stamps):
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)
    words = " ".join(f"word{i % 97}" for i in range(prompt_tokens // 3))  # ~3 tokens a word
    long_body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Summarise: {words}"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
    }
    arrived = time.perf_counter()
    long_stamps: list[float] = []
    await _timed_stream(client, long_body, long_stamps)
    answered = time.perf_counter()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    def gaps(start: float, end: float) -> list[float]:
        found = []
        for times in stamps:
            inside = [t for t in times if start <= t <= end]
            found += [b - a for a, b in itertools.pairwise(inside)]
        return found

    during = gaps(arrived - 0.5, answered)
    before = gaps(arrived - settle_s, arrived)
    return AdmissionResult(
        streams=streams,
        prompt_words=prompt_tokens // 3,
        long_ttft_s=(long_stamps[0] if long_stamps else answered) - arrived,
        max_gap_s=max(during, default=math.nan),
        max_gap_before_s=max(before, default=math.nan),
        gaps_over_2s=sum(g > 2.0 for g in during),
    )


def markdown(levels: list[LevelResult], base_url: str) -> str:
    """A Markdown table of the levels."""
    lines = [
        f"# mtplx bench-serve — {base_url}",
        "",
        "| concurrency | requests | errors | tok/s | TTFT p50 ms | TTFT p99 ms "
        "| latency p50 s | latency p99 s | engine tok/s | HTTP / engine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        lines.append(
            f"| {lv.concurrency} | {lv.requests} | {lv.errors} | {lv.tokens_per_s:.1f} "
            f"| {lv.ttft_p50 * 1e3:.0f} | {lv.ttft_p99 * 1e3:.0f} "
            f"| {lv.latency_p50:.2f} | {lv.latency_p99:.2f} "
            f"| {lv.engine_tokens_per_s:.1f} | {lv.http_efficiency:.1%} |"
        )
    return "\n".join(lines) + "\n"


async def _admission(args: argparse.Namespace) -> AdmissionResult:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await admission_gaps(client, model, args.admission, args.admission_prompt_tokens)


def main(args: argparse.Namespace) -> int:
    """Run the levels, print the table, write JSON and Markdown when --out is given."""
    admission = asyncio.run(_admission(args)) if getattr(args, "admission", 0) else None
    levels = asyncio.run(
        bench_serve(
            args.url,
            concurrency=[int(c) for c in args.concurrency.split(",") if c.strip()],
            requests_per_level=args.requests,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            api_key=args.api_key,
        )
    )
    table = markdown(levels, args.url)
    if admission is not None:
        table += (
            f"\nAdmission of a ~{args.admission_prompt_tokens}-token prompt among "
            f"{admission.streams} streams: its TTFT {admission.long_ttft_s:.2f} s; running "
            f"streams' longest inter-token gap {admission.max_gap_s:.2f} s "
            f"(before it arrived: {admission.max_gap_before_s:.2f} s), "
            f"{admission.gaps_over_2s} gaps over 2 s\n"
        )
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {"levels": [asdict(lv) for lv in levels]}
        if admission is not None:
            report["admission"] = asdict(admission)
        (args.out / "serve.json").write_text(json.dumps(report, indent=1))
        (args.out / "serve.md").write_text(table)
    return 0
