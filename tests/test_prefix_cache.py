"""The block tree of the prefix cache: exact longest-prefix matches of whole blocks, the
byte budget, least-recently-used eviction of leaves."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mtplx.prefix_cache import PrefixCache

BLOCK = 4


@dataclass
class FakeState:
    start: int
    end: int
    nbytes: int = 100


def _saver(calls: list[tuple[int, int]]):
    def save(start: int, end: int) -> FakeState:
        calls.append((start, end))
        return FakeState(start, end)

    return save


def test_only_whole_blocks_are_cached_and_each_once() -> None:
    cache = PrefixCache(10_000, block_size=BLOCK)
    calls: list[tuple[int, int]] = []
    assert cache.insert(list(range(10)), 10, _saver(calls)) == 2
    assert calls == [(0, 4), (4, 8)]
    assert cache.insert(list(range(13)), 13, _saver(calls)) == 1  # only block [8, 12) is new
    assert calls[-1] == (8, 12)
    assert cache.stats.num_blocks == 3 and cache.stats.num_bytes == 300


def test_match_is_the_longest_whole_block_prefix_with_the_same_history() -> None:
    cache = PrefixCache(10_000, block_size=BLOCK)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], 9, _saver([]))
    assert [b.state.start for b in cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0])] == [0, 4]
    assert [b.state.start for b in cache.match([1, 2, 3, 4, 5, 6, 7, 0])] == [0]
    assert cache.match([0, 2, 3, 4, 5, 6, 7, 8]) == []
    # The same tokens after a different first block are another block.
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8]) == []
    # ``limit``: a prompt's last token is never served from the cache.
    assert len(cache.match([1, 2, 3, 4, 5, 6, 7, 8], limit=7)) == 1


def test_lookups_are_counted() -> None:
    cache = PrefixCache(10_000, block_size=BLOCK)
    cache.record_lookup(0)
    cache.record_lookup(8)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (1, 1, 8)


def test_the_budget_evicts_least_recently_used_leaves_first() -> None:
    cache = PrefixCache(400, block_size=BLOCK)
    shared = [1, 1, 1, 1]
    cache.insert([*shared, 2, 2, 2, 2], 8, _saver([]))  # shared + A
    cache.insert([*shared, 3, 3, 3, 3], 8, _saver([]))  # + B
    cache.match([*shared, 2, 2, 2, 2])  # A used after B
    cache.insert([*shared, 4, 4, 4, 4, 5, 5, 5, 5], 12, _saver([]))  # + C + C2: 5 blocks
    assert cache.stats.num_bytes <= 400 and cache.stats.evictions == 1
    assert len(cache.match([*shared, 3, 3, 3, 3])) == 1  # B, the oldest leaf, went
    assert len(cache.match([*shared, 2, 2, 2, 2])) == 2
    assert len(cache.match([*shared, 4, 4, 4, 4, 5, 5, 5, 5])) == 3


def test_a_parent_outlives_its_children() -> None:
    cache = PrefixCache(200, block_size=BLOCK)
    cache.insert(list(range(12)), 12, _saver([]))  # three blocks in a chain, 300 bytes
    # The root block is the least recently used, but its descendants must go first.
    assert [b.state.start for b in cache.match(list(range(12)))] == [0, 4]
    assert cache.stats.num_blocks == 2


def test_clear_and_a_zero_budget() -> None:
    cache = PrefixCache(10_000, block_size=BLOCK)
    cache.insert(list(range(8)), 8, _saver([]))
    cache.clear()
    assert cache.match(list(range(8))) == [] and cache.stats.num_bytes == 0
    with pytest.raises(ValueError):
        PrefixCache(0)
