"""``mtplx bench-serve`` against the in-process app on the fake engine: every level runs,
counts tokens from the usage chunk, and reports no errors; percentiles on fixed numbers."""

from __future__ import annotations

import math

import httpx
import pytest

from mtplx.bench.serve_bench import bench_serve, markdown, percentile

pytestmark = pytest.mark.anyio


def test_percentile() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 50))


async def test_bench_serve_levels(app) -> None:
    levels = await bench_serve(
        "http://localhost",
        concurrency=[1, 4],
        requests_per_level=4,
        max_tokens=5,
        transport=httpx.ASGITransport(app=app),
    )
    assert [lv.concurrency for lv in levels] == [1, 4]
    for level in levels:
        assert level.errors == 0, level.error_samples
        assert level.requests == 4
        assert level.tokens == 4 * 5
        assert level.tokens_per_s > 0
        assert level.ttft_p50 <= level.latency_p50
        # the engine's seconds come from each reply's mtplx block, and fit inside its latency
        assert 0.0 <= level.http_efficiency <= 1.0
    table = markdown(levels, "http://localhost")
    assert "| concurrency |" in table and "| 4 | 4 | 0 |" in table
