"""``mtplx bench-prefix``: what the prefix cache saves, measured over HTTP as a client sees it.

Two running servers on the same model: ``--url`` with the prefix cache and ``--cold-url``
without it (``--prefix-cache-bytes 0``). Requests go to both in turn, so machine load
affects both alike:

- chat: a multi-turn conversation with a system prompt (greedy); each turn's time to first
  token on both, and whether the replies are identical.
- shared: one long system prompt, several users' questions, sent together (concurrently):
  the sum of the replies' engine prefill seconds and the wall time until every first token.
- memory (optional): many distinct long prompts to the cached server; its cache bytes
  (``/health``) against the budget after each, and the server's RSS when ``--pid`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

SYSTEM = (
    "You are a careful assistant for a small engineering team. Answer in plain language, "
    "keep answers short, give one example when it helps, and say so when you are unsure. "
)
# The chat's longer system prompt: with six 120-token replies, turn 6 is ~900 tokens.
GUIDELINES = (
    "Guidelines: prefer concrete answers to general advice; when the question is about code, "
    "name the data structure or function involved and its cost in time and memory; when it is "
    "about a decision, list the options and the one you would take; never invent facts, "
    "libraries or figures; when a question is ambiguous, answer the most likely reading and "
    "say which one you chose; use lists only for three or more items; keep the tone friendly "
    "and direct, without filler or apologies; end when the question is answered. "
)
QUESTIONS = [
    "What is a hash table?",
    "How does it handle collisions?",
    "When is a binary tree better?",
    "What does balanced mean there?",
    "Give me a Python example of a dictionary.",
    "Summarise what we discussed in two sentences.",
    "What is a queue?",
    "And a stack?",
]
WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "paper",
    "garden",
    "window",
    "copper",
    "silver",
    "forest",
    "market",
    "engine",
    "signal",
    "harbor",
    "bridge",
    "letter",
    "winter",
    "summer",
    "orange",
    "violet",
    "thunder",
    "meadow",
    "castle",
    "pocket",
    "candle",
]


@dataclass
class Reply:
    """One streamed chat reply."""

    text: str = ""
    ttft_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = math.nan


@dataclass
class ChatTurn:
    """One turn of the conversation on both servers."""

    turn: int
    prompt_tokens: int
    cold_ttft_s: float
    cached_ttft_s: float
    cached_tokens: int
    identical: bool


@dataclass
class SharedRun:
    """Several users' requests with one system prompt, sent together to one server."""

    server: str
    users: int
    prompt_tokens: int  # of one request
    prefill_s_sum: float  # the replies' engine prefill seconds, summed
    all_first_tokens_s: float  # wall time until every request had its first token
    cached_tokens: list[int] = field(default_factory=list)


async def chat_stream(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> Reply:
    """One streaming chat completion (greedy) with usage; raises on an HTTP error."""
    body = {
        "model": client.headers["x-model"],
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply, started = Reply(), time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if math.isnan(reply.ttft_s):
                        reply.ttft_s = time.perf_counter() - started
                    reply.text += content
            usage = chunk.get("usage")
            if usage:
                reply.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                reply.cached_tokens = int(details.get("cached_tokens", 0))
            stats = chunk.get("mtplx") or {}
            if "prefill_s" in stats:
                reply.prefill_s = float(stats["prefill_s"])
    return reply


async def chat_turns(
    cached: httpx.AsyncClient, cold: httpx.AsyncClient, turns: int, max_tokens: int, tag: str
) -> list[ChatTurn]:
    """The conversation, each turn on the cold server first, then on the cached one."""
    messages = [{"role": "system", "content": f"Session {tag}. {SYSTEM}{GUIDELINES}"}]
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        cold_reply = await chat_stream(cold, messages, max_tokens)
        cached_reply = await chat_stream(cached, messages, max_tokens)
        results.append(
            ChatTurn(
                turn + 1,
                cached_reply.prompt_tokens,
                cold_reply.ttft_s,
                cached_reply.ttft_s,
                cached_reply.cached_tokens,
                cold_reply.text == cached_reply.text,
            )
        )
        messages.append({"role": "assistant", "content": cached_reply.text})
    return results


def long_system_prompt(num_words: int, seed: int) -> str:
    """A system prompt of ``num_words`` words (about 1.3 tokens each), unique to ``seed``."""
    rng = random.Random(seed)
    return f"Session {seed}. {SYSTEM}Reference notes: " + " ".join(
        rng.choice(WORDS) for _ in range(num_words)
    )


async def shared_prompt(
    client: httpx.AsyncClient, server: str, users: int, system: str, max_tokens: int
) -> SharedRun:
    """``users`` questions after the same system prompt, all sent at once."""
    replies = await asyncio.gather(
        *(
            chat_stream(
                client,
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                ],
                max_tokens,
            )
            for i in range(users)
        )
    )
    return SharedRun(
        server,
        users,
        replies[0].prompt_tokens,
        sum(r.prefill_s for r in replies),
        max(r.ttft_s for r in replies),
        [r.cached_tokens for r in replies],
    )


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def memory_run(
    client: httpx.AsyncClient, prompts: int, num_words: int, pid: int | None
) -> dict[str, Any]:
    """Distinct long prompts (one token each); cache bytes against the budget after each."""
    worst, rss = 0, []
    budget = 0
    for index in range(prompts):
        content = long_system_prompt(num_words, 10_000 + index)
        await chat_stream(client, [{"role": "user", "content": content}], 1)
        cache = (await client.get("/health")).json().get("prefix_cache") or {}
        budget = cache.get("max_bytes", 0)
        worst = max(worst, cache.get("bytes", 0))
        if pid is not None and index % 10 == 9:
            rss.append(rss_bytes(pid))
    return {"prompts": prompts, "max_bytes": budget, "worst_bytes": worst, "rss_every_10": rss}


def markdown(chat: list[ChatTurn], shared: list[SharedRun], memory: dict[str, Any] | None) -> str:
    """The report."""
    lines = [
        "| turn | prompt tokens | cold TTFT s | cached TTFT s | ratio | cached tokens | same |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in chat:
        lines.append(
            f"| {t.turn} | {t.prompt_tokens} | {t.cold_ttft_s:.2f} | {t.cached_ttft_s:.2f} | "
            f"{t.cached_ttft_s / t.cold_ttft_s:.0%} | {t.cached_tokens} | {t.identical} |"
        )
    lines += ["", "| server | users | prompt tokens | prefill s (sum) | all first tokens s |"]
    lines.append("|---|---|---|---|---|")
    for run in shared:
        lines.append(
            f"| {run.server} | {run.users} | {run.prompt_tokens} | {run.prefill_s_sum:.2f} | "
            f"{run.all_first_tokens_s:.2f} |"
        )
    if len(shared) == 2:
        cold, warm = shared
        lines.append(
            f"\nShared prompt: prefill {warm.prefill_s_sum / cold.prefill_s_sum:.0%} of uncached,"
            f" wall to every first token {warm.all_first_tokens_s / cold.all_first_tokens_s:.0%}"
        )
    if memory:
        lines.append(
            f"\nMemory: {memory['prompts']} distinct prompts, cache peak "
            f"{memory['worst_bytes'] / 2**20:.1f} MiB of a {memory['max_bytes'] / 2**20:.0f} MiB "
            f"budget; server RSS every 10 prompts (MiB): "
            f"{[round(r / 2**20) for r in memory['rss_every_10']]}"
        )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> str:
    """Every part, the report as Markdown (also written to --out)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(900.0, connect=10.0)
    tag = str(int(time.time()))  # a fresh conversation: nothing of it is cached yet
    async with (
        httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout) as cached,
        httpx.AsyncClient(base_url=args.cold_url, headers=headers, timeout=timeout) as cold,
    ):
        for client in (cached, cold):  # the id each server serves its model under
            client.headers["x-model"] = (await client.get("/v1/models")).json()["data"][0]["id"]
        chat = await chat_turns(cached, cold, args.turns, args.max_tokens, tag)
        system = long_system_prompt(args.shared_words, int(tag))
        shared = [
            await shared_prompt(cold, "cold", args.users, system, args.shared_max_tokens),
            await shared_prompt(cached, "cached", args.users, system, args.shared_max_tokens),
        ]
        memory = None
        if args.memory_prompts:
            memory = await memory_run(cached, args.memory_prompts, args.memory_words, args.pid)
    report = markdown(chat, shared, memory)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix.md").write_text(report)
        data = {
            "chat": [asdict(t) for t in chat],
            "shared": [asdict(s) for s in shared],
            "memory": memory,
        }
        (args.out / "prefix.json").write_text(json.dumps(data, indent=1))
    return report


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``bench-prefix`` subcommand."""
    p = commands.add_parser(
        "bench-prefix", help="measure the prefix cache: a cached and a cold running server"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server with the cache")
    p.add_argument("--cold-url", default="http://127.0.0.1:8001", help="one without it")
    p.add_argument("--api-key")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=120, help="tokens per chat reply")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--shared-words", type=int, default=420, help="~600 tokens")
    p.add_argument("--shared-max-tokens", type=int, default=8)
    p.add_argument("--memory-prompts", type=int, default=0, help="0: skip the memory run")
    p.add_argument("--memory-words", type=int, default=220)
    p.add_argument("--pid", type=int, help="the cached server's process, for RSS")
    p.add_argument("--out", type=Path)
    return p


def main(args: argparse.Namespace) -> int:
    """Run and print the report."""
    print(asyncio.run(run(args)))
    return 0
