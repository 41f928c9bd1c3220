"""Prefix cache: the target states of token blocks already computed, shared across requests.

Prompts are cut into blocks of ``block_size`` tokens. A block is identified by its tokens
*and* every token before it (the path from the root of a tree of blocks: a block's children
are keyed by their own tokens), so a lookup is exact, never a hash collision. Each cached
block holds an opaque state saved by the batched target (``BlockState``: the KV of every
layer at those positions and the post-norm hidden states the drafters read). A new prompt
reuses the states of its longest cached prefix of whole blocks and prefills only the rest.

Bounded: ``max_bytes`` over all blocks' states; past it, the least recently used leaf
blocks are evicted first (a block is never evicted before its descendants, which would make
them unreachable). A running sequence holds a *copy* of the states it reused (in its own
row of the batched target), so eviction never touches a running sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Tokens per block: small enough that most of a shared prefix is whole blocks, large enough
# that a lookup of a few thousand tokens walks a few hundred nodes.
BLOCK_SIZE = 16


class BlockState(Protocol):
    """The states of one block, as the batched target saved them."""

    @property
    def resumable(self) -> bool:
        """Whether a row can continue right after this block (read-only: a state may
        derive it from its contents)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the state occupies."""
        ...


@dataclass(eq=False)
class Block:
    """A node of the block tree: one block of tokens after its parent's."""

    tokens: tuple[int, ...]
    parent: Block | None
    state: BlockState | None  # None only for the root
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    depth: int = 0  # blocks from the root to here, this one included

    @property
    def num_bytes(self) -> int:
        """Bytes of this block's state."""
        return 0 if self.state is None else self.state.nbytes


@dataclass
class PrefixCacheStats:
    """Counters for /metrics."""

    hits: int = 0  # lookups that reused at least one block
    misses: int = 0  # lookups that reused none
    hit_tokens: int = 0  # prompt tokens served from the cache
    evictions: int = 0  # blocks evicted
    num_bytes: int = 0  # bytes of every cached block now
    num_blocks: int = 0  # cached blocks now
    max_bytes: int = 0  # the budget


class PrefixCache:
    """Cached block states by token prefix, bounded by ``max_bytes``, LRU eviction."""

    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if max_bytes <= 0:
            raise ValueError("a prefix cache needs a positive byte budget")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.root = Block((), None, None)
        self.stats = PrefixCacheStats(max_bytes=max_bytes)
        self._recency: OrderedDict[Block, None] = OrderedDict()  # oldest first
        self.block_bytes = 0  # bytes of one block's state (all alike); 0: not known yet

    def can_keep(self, num_blocks: int) -> bool:
        """Whether the budget holds a path of ``num_blocks`` blocks (True while the size
        of a block is not known)."""
        return num_blocks * self.block_bytes <= self.max_bytes

    def match(self, tokens: Sequence[int], limit: int | None = None) -> list[Block]:
        """The cached blocks of the longest whole-block prefix of ``tokens[:limit]``, from
        the first; marks them used. Counts nothing (see ``record_lookup``)."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        node, path = self.root, []
        for start in range(0, end - self.block_size + 1, self.block_size):
            child = node.children.get(tuple(tokens[start : start + self.block_size]))
            if child is None:
                break
            path.append(child)
            node = child
        for block in path:
            self._recency.move_to_end(block)
        return path

    def record_lookup(self, num_tokens: int) -> None:
        """Count one prompt, once prefilled, that reused ``num_tokens`` tokens (0: a miss)."""
        if num_tokens:
            self.stats.hits += 1
            self.stats.hit_tokens += num_tokens
        else:
            self.stats.misses += 1

    def insert(
        self,
        tokens: Sequence[int],
        num_tokens: int,
        save: Callable[[int, int], BlockState | None],
    ) -> int:
        """Cache the whole blocks of ``tokens[:num_tokens]`` not cached yet; ``save(start,
        end)`` returns the state of positions [start, end), or None when it cannot (then
        neither that block nor those after it are cached). Returns blocks added."""
        node, added = self.root, 0
        for start in range(0, num_tokens - self.block_size + 1, self.block_size):
            key = tuple(tokens[start : start + self.block_size])
            child = node.children.get(key)
            if child is None:
                state = save(start, start + self.block_size)
                if state is None:
                    break
                child = Block(key, node, state, depth=node.depth + 1)
                node.children[key] = child
                self._recency[child] = None
                self.block_bytes = child.num_bytes
                self.stats.num_bytes += child.num_bytes
                self.stats.num_blocks += 1
                added += 1
                # Evict as blocks come (never more than one block over the budget). The new
                # block is the most recent leaf: it goes only when nothing but its own path
                # is left, and every deeper block would then go too (saved for nothing, on
                # every chunk of a prompt longer than the budget).
                self._evict()
                if node.children.get(key) is not child:
                    return added - 1
            else:
                self._recency.move_to_end(child)
            node = child
        return added

    def clear(self) -> None:
        """Drop every block."""
        self.root = Block((), None, None)
        self._recency.clear()
        self.stats.num_bytes = self.stats.num_blocks = 0

    def _evict(self) -> None:
        """Drop least recently used leaves until the blocks fit ``max_bytes``."""
        while self.stats.num_bytes > self.max_bytes:
            leaf = next(block for block in self._recency if not block.children)
            del self._recency[leaf]
            assert leaf.parent is not None
            del leaf.parent.children[leaf.tokens]
            self.stats.num_bytes -= leaf.num_bytes
            self.stats.num_blocks -= 1
            self.stats.evictions += 1
