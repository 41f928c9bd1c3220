"""The DeepSeek-form MTP heads (V3 and V4) over many rows at once: ``forward_rows`` packs
the rows' products into one forward, and each row's logits and hidden states are bitwise
a call of the head on that row alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models import LoadedModel, MTPHead, load

NUM_ROWS = 16


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4"])
def model(request: pytest.FixtureRequest) -> LoadedModel:
    return load(request.getfixturevalue(f"{request.param}_checkpoint"))


def _hidden(model: LoadedModel, row: int, count: int, salt: int) -> mx.array:
    """[1, count, H] made-up target hidden states, different for every row and feed."""
    size = model.target.hidden_size
    return mx.random.normal((1, count, size), key=mx.random.key(1000 * row + salt))


def _tokens(row: int, count: int, salt: int) -> mx.array:
    """[1, count] token ids, different for every row and feed."""
    return mx.array([[(7 * row + 3 * i + salt) % 50 + 3 for i in range(count)]], mx.int32)


def _assert_rows_alone(head: MTPHead, model: LoadedModel, sizes_per_feed: list[list[int]]) -> None:
    """Feeds of rows of the given sizes over growing caches: packed == each row alone."""
    alone = [head.make_cache() for _ in sizes_per_feed[0]]
    packed = [head.make_cache() for _ in sizes_per_feed[0]]
    for feed, sizes in enumerate(sizes_per_feed):
        hidden = [_hidden(model, row, size, feed) for row, size in enumerate(sizes)]
        tokens = [_tokens(row, size, feed) for row, size in enumerate(sizes)]
        expected = [head(h, t, c) for h, t, c in zip(hidden, tokens, alone, strict=True)]
        got = head.forward_rows(hidden, tokens, packed)
        assert len(got) == len(expected)
        for row, ((want_logits, want_hidden), (logits, out)) in enumerate(
            zip(expected, got, strict=True)
        ):
            assert logits.shape == want_logits.shape and out.shape == want_hidden.shape
            np.testing.assert_array_equal(np.array(logits), np.array(want_logits), str(row))
            np.testing.assert_array_equal(np.array(out), np.array(want_hidden), str(row))


def test_forward_rows_gives_each_row_its_alone_outputs(model: LoadedModel) -> None:
    """16 rows: a prompt's worth of pairs of different lengths, then verify-sized feeds of
    1 to 6 tokens over caches of different lengths, packed: every row's logits and hidden
    states equal a call of the head on that row alone, bit for bit."""
    sizes = [[8 + 5 * row for row in range(NUM_ROWS)]]
    sizes += [[1 + (row + feed) % 6 for row in range(NUM_ROWS)] for feed in range(1, 4)]
    for head in model.mtp_heads:
        _assert_rows_alone(head, model, sizes)


def test_forward_rows_packs_the_rows(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's products run once for a pack of rows, not once per row: the head's
    input projection sees every row's tokens in one call."""
    head = model.mtp_heads[0]
    module = head.module  # type: ignore[attr-defined]
    name = "eh_proj" if "eh_proj" in module else "e_proj"
    projection = getattr(module, name)
    calls: list[int] = []

    class Recording(type(projection)):  # type: ignore[misc]
        def __call__(self, x: mx.array) -> mx.array:
            calls.append(int(x.shape[1]))
            return super().__call__(x)

    monkeypatch.setattr(projection, "__class__", Recording)
    caches = [head.make_cache() for _ in range(4)]
    sizes = [3, 1, 2, 5]
    hidden = [_hidden(model, row, size, 0) for row, size in enumerate(sizes)]
    tokens = [_tokens(row, size, 0) for row, size in enumerate(sizes)]
    mx.eval(head.forward_rows(hidden, tokens, caches))
    assert calls == [sum(sizes)]
