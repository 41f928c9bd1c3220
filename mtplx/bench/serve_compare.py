"""``mtplx bench-serve --compare-plain``: speculative against plain decoding on a running
server, measured as a client sees it.

For every temperature, repeat and prompt, the same streamed chat completion twice: once
with the server's speculative configuration (its default, or ``drafter`` / ``depth``) and
once with plain decoding (``"mtplx": {"depth": 0}``), the order alternating from pair to
pair so that a slow spell of the machine weighs on both sides alike. A pair's ratio is the
speculative reply's decode speed over the plain one's (tokens after the first over the
seconds after the first content chunk, on the client's clock). Acceptance per draft
position comes from each reply's ``"mtplx"`` block. At temperature 0 both replies of a
pair must be the same text: speculative decoding is exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from mtplx.bench.prompts import DEFAULT_PROMPT_DIR, Prompt, load_prompts
from mtplx.bench.serve_bench import RequestResult, stream_one


@dataclass
class Pair:
    """One prompt's two replies at one temperature and repeat."""

    temperature: float
    repeat: int
    category: str
    prompt_id: str
    speculative: RequestResult
    plain: RequestResult

    @property
    def ratio(self) -> float:
        """Speculative decode tokens/s over plain (NaN when either is unmeasurable)."""
        return self.speculative.decode_tokens_per_s / self.plain.decode_tokens_per_s


@dataclass
class Summary:
    """The pairs of one temperature and category."""

    temperature: float
    category: str
    pairs: int
    errors: int
    ratio_median: float
    ratio_min: float
    ratio_max: float
    aggregate_ratio: float  # all speculative tokens/s over all plain tokens/s
    speculative_tokens_per_s: float
    plain_tokens_per_s: float
    acceptance_per_position: list[float]
    mean_acceptance_length: float  # committed tokens per drafting cycle
    same_text: int  # pairs whose two replies are the same text


def request_body(
    model: str, prompt: Prompt, temperature: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """A streamed chat completion of ``prompt`` (speculative options are added per side)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def compare(
    client: httpx.AsyncClient,
    prompts: list[Prompt],
    *,
    temperatures: list[float],
    repeats: int,
    max_tokens: int,
    speculative: dict[str, Any] | None = None,
) -> list[Pair]:
    """Every (temperature, repeat, prompt) pair, one request at a time. ``speculative``:
    the speculative side's ``"mtplx"`` options (None: the server's default)."""
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    pairs = []
    for temperature in temperatures:
        for repeat in range(repeats):
            for index, prompt in enumerate(prompts):
                body = request_body(model, prompt, temperature, max_tokens, seed=index)
                sides = {"speculative": body, "plain": {**body, "mtplx": {"depth": 0}}}
                if speculative:
                    sides["speculative"] = {**body, "mtplx": speculative}
                order = ["speculative", "plain"]
                if (repeat + index) % 2:
                    order.reverse()
                replies = {side: await stream_one(client, sides[side]) for side in order}
                pairs.append(
                    Pair(temperature, repeat, prompt.category, prompt.prompt_id, **replies)
                )
    return pairs


def summarize(pairs: list[Pair]) -> list[Summary]:
    """One summary per (temperature, category), in order of first appearance."""
    groups: dict[tuple[float, str], list[Pair]] = {}
    for pair in pairs:
        groups.setdefault((pair.temperature, pair.category), []).append(pair)
    summaries = []
    for (temperature, category), group in groups.items():
        good = [
            p
            for p in group
            if p.speculative.error is None and p.plain.error is None and not math.isnan(p.ratio)
        ]
        ratios = [p.ratio for p in good] or [math.nan]
        speculative_rate = _rate([p.speculative for p in good])
        plain_rate = _rate([p.plain for p in good])
        summaries.append(
            Summary(
                temperature=temperature,
                category=category,
                pairs=len(good),
                errors=len(group) - len(good),
                ratio_median=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                aggregate_ratio=speculative_rate / plain_rate,
                speculative_tokens_per_s=speculative_rate,
                plain_tokens_per_s=plain_rate,
                acceptance_per_position=_acceptance([p.speculative for p in good]),
                mean_acceptance_length=_acceptance_length([p.speculative for p in good]),
                same_text=sum(p.speculative.text == p.plain.text for p in good),
            )
        )
    return summaries


def _rate(replies: list[RequestResult]) -> float:
    """Decode tokens over decode seconds, summed over ``replies``."""
    tokens = sum(r.tokens - 1 for r in replies)
    seconds = sum((r.tokens - 1) / r.decode_tokens_per_s for r in replies)
    return tokens / seconds if seconds > 0 else math.nan


def _acceptance(replies: list[RequestResult]) -> list[float]:
    """Accepted over drafted per draft position, summed over ``replies``."""
    accepted: list[int] = []
    drafted: list[int] = []
    for reply in replies:
        for totals, key in ((accepted, "accepted_per_position"), (drafted, "drafted_per_position")):
            for position, count in enumerate(reply.mtplx.get(key, [])):
                if position == len(totals):
                    totals.append(0)
                totals[position] += count
    accepted += [0] * (len(drafted) - len(accepted))
    return [a / d if d else math.nan for a, d in zip(accepted, drafted, strict=True)]


def _acceptance_length(replies: list[RequestResult]) -> float:
    """Tokens committed per drafting cycle (a cycle drafts position 1 once)."""
    cycles = sum((r.mtplx.get("drafted_per_position") or [0])[0] for r in replies)
    accepted = sum(sum(r.mtplx.get("accepted_per_position", [])) for r in replies)
    return (cycles + accepted) / cycles if cycles else math.nan


def markdown(summaries: list[Summary], base_url: str, speculative: str) -> str:
    """A Markdown table of the summaries."""
    lines = [
        f"# mtplx bench-serve --compare-plain — {base_url}",
        "",
        f"speculative side: {speculative}; ratio = its decode tok/s over plain decoding's, "
        "per pair (median, min–max) and over all pairs (aggregate)",
        "",
        "| T | category | pairs | spec. tok/s | plain tok/s | ratio | aggregate "
        "| acc./pos. | mean acc. len | same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        positions = " ".join(f"{a:.2f}" for a in s.acceptance_per_position) or "–"
        same = f"{s.same_text}/{s.pairs}" if s.temperature == 0 else "–"
        lines.append(
            f"| {s.temperature:g} | {s.category} | {s.pairs}"
            + (f" ({s.errors} failed)" if s.errors else "")
            + f" | {s.speculative_tokens_per_s:.1f} | {s.plain_tokens_per_s:.1f} "
            f"| {s.ratio_median:.2f}x ({s.ratio_min:.2f}–{s.ratio_max:.2f}) "
            f"| {s.aggregate_ratio:.2f}x | {positions} | {s.mean_acceptance_length:.2f} | {same} |"
        )
    return "\n".join(lines) + "\n"


async def _run(args: argparse.Namespace, speculative: dict[str, Any]) -> list[Pair]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    prompts = load_prompts(
        args.prompt_dir or DEFAULT_PROMPT_DIR, args.categories, args.prompts_per_category
    )
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout) as client:
        return await compare(
            client,
            prompts,
            temperatures=[float(t) for t in args.temperatures.split(",") if t.strip()],
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            speculative=speculative or None,
        )


def main(args: argparse.Namespace) -> int:
    """Run the comparison, print the table, write JSON and Markdown when --out is given."""
    speculative = {
        key: value
        for key, value in (("drafter", args.drafter), ("depth", args.depth))
        if value is not None
    }
    pairs = asyncio.run(_run(args, speculative))
    summaries = summarize(pairs)
    label = json.dumps(speculative) if speculative else "the server's default"
    table = markdown(summaries, args.url, label)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "summaries": [asdict(s) for s in summaries],
            "pairs": [asdict(p) for p in pairs],
        }
        (args.out / "compare.json").write_text(json.dumps(report, indent=1))
        (args.out / "compare.md").write_text(table)
    return 1 if any(s.errors for s in summaries) else 0
