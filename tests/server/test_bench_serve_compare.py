"""``mtplx bench-serve --compare-plain`` against the in-process app on the real engine (the
tiny fixture checkpoint with its MTP head): pairs alternate their order, greedy replies are
the same text on both sides, acceptance comes from the replies' ``"mtplx"`` blocks."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from mtplx.bench import serve_compare
from mtplx.bench.prompts import Prompt
from mtplx.bench.serve_bench import RequestResult
from mtplx.bench.serve_compare import Pair, compare, markdown, summarize

pytestmark = pytest.mark.anyio

PROMPTS = [Prompt("chat", "chat-1", "Say hello."), Prompt("chat", "chat-2", "Count to five.")]


@pytest.fixture
def app(make_app: Any, real_engine: Any) -> Any:
    return make_app(real_engine)


async def test_pairs_compare_a_forced_drafter_with_plain_decoding(app: Any) -> None:
    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        base_url="http://localhost", transport=transport, event_hooks={"request": [record]}
    ) as client:
        pairs = await compare(
            client,
            PROMPTS,
            temperatures=[0.0, 1.0],
            repeats=2,
            max_tokens=12,
            speculative={"drafter": "mtp", "depth": 2},
        )
    assert len(pairs) == 2 * 2 * len(PROMPTS) and len(sent) == 2 * len(pairs)
    sides = [body.get("mtplx") for body in sent]
    # each pair's order alternates: speculative first, then plain first, ...
    assert sides[:4] == [
        {"drafter": "mtp", "depth": 2},
        {"depth": 0},
        {"depth": 0},
        {"drafter": "mtp", "depth": 2},
    ]
    for pair in pairs:
        assert pair.speculative.error is None and pair.plain.error is None
        assert pair.speculative.tokens == pair.plain.tokens == 12  # the fixture never stops
        assert pair.plain.mtplx["drafted_per_position"] == []
        assert sum(pair.speculative.mtplx["drafted_per_position"]) > 0
        if pair.temperature == 0:
            assert pair.speculative.text == pair.plain.text  # exact speculative decoding
        assert pair.ratio > 0
    (greedy, sampled) = summarize(pairs)
    assert (greedy.temperature, sampled.temperature) == (0.0, 1.0)
    assert greedy.pairs == sampled.pairs == 2 * len(PROMPTS) and greedy.errors == 0
    assert greedy.same_text == greedy.pairs
    assert len(greedy.acceptance_per_position) == 2
    assert all(0 <= a <= 1 for a in greedy.acceptance_per_position)
    assert 1 <= greedy.mean_acceptance_length <= 3
    table = markdown([greedy, sampled], "http://localhost", "mtp")
    assert f"| 0 | chat | {greedy.pairs} |" in table and "| 1 | chat |" in table


def reply(tokens: int, ttft: float, last: float, **mtplx: Any) -> RequestResult:
    return RequestResult(ttft=ttft, last_content=last, tokens=tokens, mtplx=mtplx)


def test_summary_arithmetic_on_fixed_replies() -> None:
    fast = reply(11, 0.1, 1.1, drafted_per_position=[8, 2], accepted_per_position=[4, 1])
    slow = reply(11, 0.1, 2.1)
    pairs = [
        Pair(0.0, 0, "chat", "a", speculative=fast, plain=slow),  # 10 tok/s vs 5: 2x
        Pair(0.0, 1, "chat", "a", speculative=slow, plain=slow),  # 1x, no drafts
        Pair(0.0, 2, "chat", "a", speculative=reply(1, 0.1, 0.1), plain=slow),  # unmeasurable
    ]
    (summary,) = summarize(pairs)
    assert summary.pairs == 2 and summary.errors == 1
    assert summary.ratio_median == pytest.approx(1.5)
    assert (summary.ratio_min, summary.ratio_max) == pytest.approx((1.0, 2.0))
    # 20 tokens in 1 + 2 s against 20 in 2 + 2 s
    assert summary.aggregate_ratio == pytest.approx((20 / 3) / (20 / 4))
    assert summary.acceptance_per_position == pytest.approx([0.5, 0.5])
    assert summary.mean_acceptance_length == pytest.approx((8 + 5) / 8)
    assert math.isnan(reply(1, 0.1, 0.1).decode_tokens_per_s)


def test_cli_writes_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mtplx.cli import main

    async def fake_run(args: argparse.Namespace, speculative: dict[str, Any]) -> list[Pair]:
        assert speculative == {"depth": 3} and args.temperatures == "0"
        assert args.categories == ["chat", "code"] and args.repeats == 1
        return [Pair(0.0, 0, "chat", "a", reply(5, 0.1, 0.5), reply(5, 0.1, 0.9))]

    monkeypatch.setattr(serve_compare, "_run", fake_run)
    argv = ["bench-serve", "--compare-plain", "--depth", "3", "--temperatures", "0"]
    argv += ["--categories", "chat,code", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "| 0 | chat | 1 |" in capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["summaries"][0]["ratio_median"] == pytest.approx(2.0)
    assert (tmp_path / "compare.md").exists()
