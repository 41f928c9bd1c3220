"""The engine's side of the prefix cache: load cached blocks into a sequence's row, let a
waiting prompt wait for blocks an earlier one is feeding, save a row's blocks.

Where a row may resume (its ``stride``): after any block for a target whose states are
bitwise the same however a prompt is chunked (``resumes_anywhere``: the slot store), so
cached blocks of a reply are exact too; for the others (one forward per row: hybrid
recurrent, MLA), only at multiples of the prefill
chunk and only from prompt blocks (their prompt chunks are fixed by the prompt alone, so the
states there are bitwise a cold prefill's, and recurrent state is snapshotted at chunk
ends; a reply's states come from other shapes of forward and are not cached)."""

from __future__ import annotations

import logging

import mlx.core as mx

from mtplx.models.rows import BatchedTarget
from mtplx.prefix_cache import BLOCK_SIZE, BlockState, PrefixCache
from mtplx.sequence import Sequence

logger = logging.getLogger(__name__)


class PrefixReuse:
    """A prefix cache wired to one batched target."""

    def __init__(self, cache: PrefixCache, target: BatchedTarget, prefill_chunk_size: int) -> None:
        self.cache = cache
        self.target = target
        self.caches_replies = target.resumes_anywhere
        self.stride = cache.block_size if self.caches_replies else prefill_chunk_size
        self._learn_block_size()

    @classmethod
    def build(
        cls, max_bytes: int, target: BatchedTarget, prefill_chunk_size: int, name: str
    ) -> PrefixReuse | None:
        """A prefix cache of ``max_bytes`` for ``target``, or None (off, or the target's
        caches cannot be saved: a warning says why)."""
        if max_bytes <= 0:
            return None
        if not target.saves_blocks:
            logger.warning("no prefix cache for %s: its layer caches cannot be saved", name)
            return None
        if not target.resumes_anywhere and prefill_chunk_size % BLOCK_SIZE:
            logger.warning(
                "no prefix cache for %s: prefill_chunk_size %d is not a multiple of %d",
                name,
                prefill_chunk_size,
                BLOCK_SIZE,
            )
            return None
        return cls(PrefixCache(max_bytes), target, prefill_chunk_size)

    def _learn_block_size(self) -> None:
        """Tell the cache a block's size up front when the target knows it."""
        block_bytes = self.target.block_nbytes(self.cache.block_size)
        if block_bytes is not None:
            self.cache.block_bytes = block_bytes

    def restart(self) -> None:
        """An empty cache with fresh counters (after calibration's own prompts)."""
        self.cache = PrefixCache(self.cache.max_bytes, self.cache.block_size)
        self._learn_block_size()

    def reuse(self, sequence: Sequence) -> None:
        """Load the cached blocks that continue the row's fed prompt, up to the last place
        the row may resume. The prompt's last token is always fed (its logits give the
        first token). Not for a row that scores its prompt: that needs every position's
        logits, which cached blocks do not hold."""
        if sequence.num_prefilled % self.stride or sequence.request.prompt_logprobs is not None:
            return
        size = self.cache.block_size
        blocks = self.cache.match(sequence.tokens, sequence.num_prompt_tokens - 1)
        usable = len(blocks)
        while usable and (usable * size % self.stride or not blocks[usable - 1].state.resumable):  # type: ignore[union-attr]
            usable -= 1
        new = blocks[sequence.num_prefilled // size : usable]
        if not new:
            return
        hidden = self.target.load_blocks(sequence.row, [block.state for block in new])
        if sequence.drafter is not None and sequence.drafter.needs_hidden:
            sequence.prefill_hidden.append(hidden)
        sequence.num_prefilled += len(new) * size
        sequence.stats.cached_tokens += len(new) * size

    def fed_by(self, sequence: Sequence, earlier: list[Sequence]) -> bool:
        """Whether an earlier waiting prompt will feed the row's next stride itself: the row
        then waits for it to be cached rather than computing it again (not for blocks past
        what the budget keeps: evicted at once, they would only delay the row)."""
        end = sequence.num_prefilled + self.stride
        if sequence.request.prompt_logprobs is not None:
            return False  # it reuses no blocks (``reuse``): it feeds every position itself
        if sequence.num_prefilled % self.stride or end >= sequence.num_prompt_tokens:
            return False
        if not self.cache.can_keep(end // self.cache.block_size):
            return False
        head = sequence.tokens[:end]
        return any(
            other.num_prefilled < end <= other.num_prompt_tokens and other.tokens[:end] == head
            for other in earlier
        )

    def remember(
        self, sequence: Sequence, num_tokens: int, chunk: tuple[int, mx.array] | None = None
    ) -> None:
        """Cache the row's whole blocks among its first ``num_tokens`` positions. ``chunk``:
        (its first position, its hidden states [T, H]) for targets that do not keep hidden
        states; blocks outside it that are not cached any more are not saved again."""
        row = sequence.row

        def save(start: int, end: int) -> BlockState | None:
            hidden = None
            if chunk is not None and start >= chunk[0]:
                hidden = chunk[1][start - chunk[0] : end - chunk[0]]
            return self.target.save_block(row, start, end, hidden)

        try:
            self.cache.insert(sequence.tokens, min(num_tokens, len(sequence.tokens)), save)
        except Exception:
            logger.exception("could not cache a prefix")
