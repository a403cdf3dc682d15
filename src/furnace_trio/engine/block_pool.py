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

Prefix cache. A full block may carry a content *key*: the chain hash of every token up to
and including it (:func:`block_key`), so equal keys mean equal prefixes, not just equal
blocks. A keyed block whose refcount drops to 0 goes to an LRU of *evictable* blocks
instead of the free list (:meth:`_release` is the one place that decides); it keeps its KV
and its key, so a later request with the same prefix revives it (:meth:`acquire`).
:meth:`allocate` takes from the free list first and evicts from that LRU only when it must.
``num_free`` counts free plus evictable blocks, so admission needs no change::

    free list   [9, 4]            never keyed (or evicted): no content worth keeping
    evictable   [2, 7] (LRU)      refcount 0, keyed, revivable until allocate() needs them
    used        {3: 2, 5: 1, ..}  refcount >= 1 (running sequences, session pins)

A keyed block is never written again: only *full* blocks get keys, and a sequence only
writes positions past its last full block. Keys are 16-byte BLAKE2b digests over the
parent's key and the block's token ids, so a collision (which would silently hand one
request another's KV) is as unlikely as a cryptographic one; reuse is by exact prefix only.

Partial matches. A keyed block registered with its parent's key and its tokens is also
indexed under (parent key, first token) (:meth:`match_partial`): a prompt whose next block
differs from a cached one after a few tokens (the same system message, then another user
message) reuses those tokens through a copy of that block, as a fork copies its partial
last block. The index keeps the :data:`PARTIAL_CANDIDATES` most recently registered blocks
per (parent, first token); evicting a block drops it from the index.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from furnace_trio.core.tokens import common_prefix

BlockKey = bytes

#: Blocks :meth:`BlockPool.match_partial` compares per (parent key, first token): the most
#: recently registered ones (a bound on the work of one admission).
PARTIAL_CANDIDATES = 32


def block_key(parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """The chain key of a full block: a hash of its parent's key and its own token ids."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of every full block of ``token_ids`` (a partial tail has none)."""
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class Fork:
    """The result of :meth:`BlockPool.fork`: the child's block table and the copies to run."""

    block_table: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]


class BlockPool:
    """Refcounted KV blocks with a prefix cache. Plain Python, used by one thread.

    Invariants: ``len(free list) + len(evictable) + used == num_blocks``; a block is in the
    free list or the evictable LRU exactly when its refcount is 0, and in the LRU exactly
    when it also has a key; ``key -> block`` and ``block -> key`` are inverse maps.
    """

    __slots__ = (
        "_block_keys",
        "_cached",
        "_evictable",
        "_free",
        "_partial",
        "_partial_of",
        "_refcounts",
        "block_size",
        "caching",
        "evictions",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        # FIFO reuse: a just-freed block is reused last, which keeps stale-block bugs visible
        # in tests.
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[BlockKey, int] = {}
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        # (parent key, first token) -> {block: its tokens}, oldest first; and block -> its entry
        self._partial: dict[tuple[BlockKey | None, int], OrderedDict[int, tuple[int, ...]]] = {}
        self._partial_of: dict[int, tuple[BlockKey | None, int]] = {}
        self.evictions = 0
        self.caching = caching  # False: register() keys nothing, so nothing is ever reused

    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` could hand out: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_unreferenced_cached(self) -> int:
        """Cached blocks no one references: kept for reuse, handed out when needed."""
        return len(self._evictable)

    @property
    def num_references(self) -> int:
        """All references held (a block shared by two owners counts twice)."""
        return sum(self._refcounts)

    @property
    def num_cached(self) -> int:
        """Blocks holding a key (used or evictable)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with refcount 1, or ``None`` (and nothing taken) without room.

        Evicts least-recently-used cached blocks once the free list is empty.
        """
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.num_free:
            return None
        blocks: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                key = self._block_keys[block]
                self._block_keys[block] = None
                if key is not None:
                    del self._cached[key]
                self._unindex(block)
                self.evictions += 1
            self._refcounts[block] = 1
            blocks.append(block)
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

    # -- prefix cache -----------------------------------------------------------------------

    def match(self, keys: Iterable[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (nothing is referenced)."""
        blocks: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are unreferenced: acquiring them shrinks ``num_free``."""
        return sum(1 for b in blocks if self._refcounts[b] == 0)

    def acquire(self, blocks: Iterable[int]) -> None:
        """Reference cached blocks (from :meth:`match`), reviving evictable ones."""
        for block in blocks:
            if self._block_keys[block] is None:
                raise ValueError(f"block {block} is not cached")
            if self._refcounts[block] == 0:
                del self._evictable[block]
            self._refcounts[block] += 1

    def register(
        self,
        block: int,
        key: BlockKey,
        parent: BlockKey | None = None,
        token_ids: Sequence[int] = (),
    ) -> bool:
        """Give a used, full block its key. Whether it is now the key's cached block.

        ``False`` when another block holds the key already (two requests computed the same
        prefix at once): that one stays the cached copy, this one is freed normally.
        With its ``token_ids`` (and ``parent``, the key of the block before it; ``None``
        for a first block) a newly cached block is also a candidate of
        :meth:`match_partial`.
        """
        if self._refcounts[block] < 1:
            raise ValueError(f"block {block} is free; only used blocks can be cached")
        if not self.caching:
            return False
        current = self._block_keys[block]
        if current is not None:
            if current != key:
                raise ValueError(f"block {block} is cached under another key")
            return True
        if key in self._cached:
            return False
        self._cached[key] = block
        self._block_keys[block] = key
        if token_ids:
            entry = (parent, token_ids[0])
            candidates = self._partial.setdefault(entry, OrderedDict())
            candidates[block] = tuple(token_ids)
            self._partial_of[block] = entry
            if len(candidates) > PARTIAL_CANDIDATES:
                oldest, _ = candidates.popitem(last=False)
                del self._partial_of[oldest]
        return True

    def match_partial(
        self, parent: BlockKey | None, token_ids: Sequence[int]
    ) -> tuple[int, int] | None:
        """The cached block after ``parent`` (``None``: a first block) whose tokens begin
        with the longest run of ``token_ids`` (at most a block of them), and that run's
        length; ``None`` when no candidate shares even the first token. Nothing is
        referenced."""
        if not token_ids:
            return None
        candidates = self._partial.get((parent, token_ids[0]))
        if not candidates:
            return None
        best, best_len = -1, 0
        wanted = token_ids[: self.block_size]
        for block, tokens in candidates.items():
            n = common_prefix(tokens, wanted)
            if n > best_len:
                best, best_len = block, n
        return best, best_len

    def key_of(self, block: int) -> BlockKey | None:
        return self._block_keys[block]

    # -- sharing ----------------------------------------------------------------------------
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

    def _unindex(self, block: int) -> None:
        entry = self._partial_of.pop(block, None)
        if entry is not None:
            candidates = self._partial[entry]
            del candidates[block]
            if not candidates:
                del self._partial[entry]

    def _release(self, block: int) -> None:
        if self._block_keys[block] is not None:
            self._evictable[block] = None  # most recently used at the end
        else:
            self._free.append(block)
