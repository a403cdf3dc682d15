"""A refcounted allocator over the paged KV pool.

The pool hands out block ids ``0 .. num_blocks - 1``. A block is either *free* (refcount 0,
in the free list) or *used* (refcount >= 1). Sequences that share a prefix share its full
blocks by reference; a partially filled last block is never shared, because both owners
would write their next token into the same slot, so a fork copies it instead::

    parent  table (3, 8, 5)     block_size = 4, 10 tokens: block 5 holds 2 tokens
    fork -> child  (3, 8, 11)   3 and 8 shared (refcount 2); 5 -> 11 copied
            copies [(5, 11)]    (StepPlan.block_copies, run before the forward pass)

Invariants: ``num_free + num_used == num_blocks``; a block is in the free list exactly when
its refcount is 0; ``allocate`` either returns ``n`` blocks or ``None`` and changes nothing.

Prefix caching (a later addition) slots in without a rewrite: a full block gets a content
key (the hash of every token up to and including it); when its refcount drops to 0 it goes
to an LRU of *evictable* cached blocks instead of the free list (:meth:`_release` is the one
place that decides), ``allocate`` takes from the free list first and then evicts from that
LRU, and a lookup by key increfs a cached block (reviving it from the LRU). ``num_free``
then counts free plus evictable blocks, so admission needs no change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fork:
    """The result of :meth:`BlockPool.fork`: the child's block table and the copies to run."""

    block_table: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]


class BlockPool:
    """Refcounted KV blocks. Plain Python: touched only by the scheduler, on one thread."""

    __slots__ = ("_free", "_refcounts", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        # FIFO reuse: a just-freed block is reused last, which keeps stale-block bugs visible
        # in tests (and is the order a prefix cache's LRU would want anyway).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with refcount 1, or ``None`` (and nothing taken) without room."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share used blocks: each must already be referenced."""
        for block in blocks:
            if self._refcounts[block] < 1:
                raise ValueError(f"block {block} is free; only used blocks can be shared")
            self._refcounts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block with no references left is released."""
        for block in blocks:
            count = self._refcounts[block]
            if count < 1:
                raise ValueError(f"block {block} is already free")
            self._refcounts[block] = count - 1
            if count == 1:
                self._release(block)

    def fork(self, block_table: Sequence[int], num_tokens: int) -> Fork | None:
        """A child sharing the first ``num_tokens`` tokens of ``block_table``.

        Full blocks are shared (incref); a partial last block is copied into a fresh block.
        ``None`` (nothing changed) when the copy finds no free block.
        """
        num_full, partial = divmod(num_tokens, self.block_size)
        if self.blocks_for(num_tokens) > len(block_table):
            raise ValueError("the block table does not cover num_tokens")
        shared = list(block_table[:num_full])
        copies: tuple[tuple[int, int], ...] = ()
        if partial:
            fresh = self.allocate(1)
            if fresh is None:
                return None
            copies = ((block_table[num_full], fresh[0]),)
            shared_table = (*shared, fresh[0])
        else:
            shared_table = tuple(shared)
        self.incref(shared)
        return Fork(block_table=shared_table, copies=copies)

    def _release(self, block: int) -> None:
        # The prefix cache hooks in here: a cached full block would go to the evictable LRU.
        self._free.append(block)
