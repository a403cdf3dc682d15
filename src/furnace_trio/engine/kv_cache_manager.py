"""The KV cache manager: which blocks each sequence holds, and whether a request fits.

The scheduler decides *what* runs; this module decides whether there is KV memory for it
and keeps every block table. Plain Python over the refcounted
:class:`~furnace_trio.engine.block_pool.BlockPool`, in the spirit of vLLM v1's
``KVCacheManager``: the scheduler gets small dataclasses (:class:`ComputedBlocks`,
:class:`RequestBlocks`, :class:`SeqBlocks`, :class:`KeptKV`) and ``None`` where there is
no room, and never touches the pool's refcounts itself.

Memory is **reserved, never preempted.** :meth:`KVCacheManager.allocate_request` admits a
request only if the worst case of its blocks (prompt + ``max_tokens`` for each of its
``n`` samples, full prompt blocks shared; :meth:`KVCacheManager.blocks_needed`) fits in
the free blocks that other reservations have not claimed. Blocks are then taken from that
reservation as positions are written (:meth:`KVCacheManager.allocate_slots`), so a
sequence once admitted can always finish::

    pool:  | used (written) | reserved, not yet written | free, unclaimed |
             num_used         num_reserved                admission draws here

Prefix cache: :meth:`KVCacheManager.get_computed_blocks` finds the longest cached run of a
prompt's full blocks (by chain key), short of the block that holds the prompt's last
token, which is always computed (its logits are sampled) and so never written into a
shared block. Then, token by token, the cached block after that run whose first tokens
continue the prompt furthest (:meth:`BlockPool.match_partial
<furnace_trio.engine.block_pool.BlockPool.match_partial>`; the last prompt token again
excepted): it is copied into the request's next block, as a fork copies its partial
block, and the request computes from the first token it does not share. Reused blocks
need no reservation, but reviving unreferenced ones (a copy's source among them) takes
them out of the free count that other reservations rely on, so admission counts them.
After each step :meth:`KVCacheManager.cache_blocks` keys the blocks that became full.

Forks (``n > 1``): a child shares the prompt's full blocks and copies its partial last
block (:meth:`KVCacheManager.fork`). Those copies and the prefix cache's reach the runner
through :meth:`KVCacheManager.take_block_copies`, dropped for sequences freed in the
meantime. A prefix copy's source stays referenced until then: the plan that carries the
copy runs it before any later schedule could hand the source out again.

Pins (sessions): :meth:`KVCacheManager.pin` takes one reference to each cached block of
what a finished sequence computed (:class:`KeptKV`); :meth:`KVCacheManager.unpin` drops
them.

Freeing (:meth:`KVCacheManager.free`) is synchronous and safe while a step is in flight:
blocks are only handed out again by the next ``schedule()``, which runs after that step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine.block_pool import BlockKey, BlockPool, block_key, prefix_keys

__all__ = [
    "NO_COMPUTED_BLOCKS",
    "ComputedBlocks",
    "KVCacheManager",
    "KeptKV",
    "RequestBlocks",
    "SeqBlocks",
]

_NO_NEW_BLOCKS: tuple[int, ...] = ()


@dataclass(slots=True, eq=False)
class SeqBlocks:
    """One sequence's KV, owned by the manager; the scheduler reads ``block_table``.

    Invariants: ``block_table`` covers every position the sequence has written;
    ``block_keys`` are the chain keys of its first full blocks; ``reserved`` more blocks
    may still be allocated for it without asking the pool for room.
    """

    prompt_keys: tuple[BlockKey, ...]  # the request's prompt's full-block keys
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prompt's longest cached prefix, nothing referenced yet: its full blocks, the cached
    block whose first tokens continue it (``partial``, copied rather than shared; ``None``
    when there is none) and the tokens of both."""

    blocks: tuple[int, ...]
    num_tokens: int
    partial: int | None = None

    @property
    def referenced(self) -> tuple[int, ...]:
        """The blocks admission references: the shared ones and the copy's source."""
        return self.blocks if self.partial is None else (*self.blocks, self.partial)


NO_COMPUTED_BLOCKS = ComputedBlocks((), 0)


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """What admission hands out: the prompt's sequence, and for ``n > 1`` each sample's
    (empty until :meth:`KVCacheManager.fork`; ``()`` when ``n == 1``, whose prompt
    sequence is its sample)."""

    prompt: SeqBlocks
    samples: tuple[SeqBlocks, ...]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class KeptKV:
    """What a finished ``keep_kv`` request leaves pinned: one reference to each block.

    ``token_ids`` are the tokens whose KV ``blocks`` hold (full blocks only);
    ``output_token_ids`` is what the request generated (EOS excluded).
    """

    token_ids: tuple[int, ...]
    blocks: tuple[int, ...]
    output_token_ids: tuple[int, ...]


class KVCacheManager:
    """Reservations, block tables, prefix-cache matches, forks and pins over one pool."""

    def __init__(self, pool: BlockPool) -> None:
        #: The allocator underneath (read it for counts; change blocks through the manager).
        self.pool = pool
        self.block_size = pool.block_size
        self._reserved = 0  # blocks reserved by admitted sequences, not yet allocated
        self._copies: list[tuple[int, int, SeqBlocks]] = []  # (src, dst, the copy's owner)
        self._copy_sources: list[int] = []  # prefix copies' sources, referenced until taken
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_reserved(self) -> int:
        """Blocks admitted sequences may still allocate (not counted in ``pool.num_used``)."""
        return self._reserved

    def blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Worst-case KV blocks of a request: what admission reserves.

        The last sampled token is never fed back, so a sample writes at most
        ``prompt + max_tokens - 1`` positions.
        """
        pool = self.pool
        last = num_prompt_tokens + params.max_tokens - 1
        if params.n == 1:
            return pool.blocks_for(last)
        per_child = pool.blocks_for(last) - num_prompt_tokens // self.block_size
        return pool.blocks_for(num_prompt_tokens) + params.n * per_child

    def prompt_keys(self, prompt: Sequence[int]) -> tuple[BlockKey, ...]:
        """The chain keys of a prompt's full blocks, computed once per request."""
        return tuple(prefix_keys(prompt, self.block_size))

    # -- admission --------------------------------------------------------------------------

    def get_computed_blocks(
        self, prompt_keys: Sequence[BlockKey], prompt: Sequence[int]
    ) -> ComputedBlocks:
        """The prompt's longest cached prefix, short of its last token: full blocks, then
        a cached block sharing the next tokens. Nothing is referenced until
        :meth:`allocate_request`."""
        bs = self.block_size
        usable = len(prompt) - 1
        blocks = self.pool.match(prompt_keys[: usable // bs])
        num_tokens = len(blocks) * bs
        parent = prompt_keys[len(blocks) - 1] if blocks else None
        partial = self.pool.match_partial(parent, prompt[num_tokens:usable])
        if partial is None:
            return ComputedBlocks(tuple(blocks), num_tokens)
        source, shared = partial
        return ComputedBlocks(tuple(blocks), num_tokens + shared, source)

    def without_partial(self, computed: ComputedBlocks) -> ComputedBlocks:
        """``computed`` short of its copied block: what admission falls back to when the
        copy's source, held until the copy runs, is the one block too many."""
        return ComputedBlocks(computed.blocks, len(computed.blocks) * self.block_size)

    def shortage(self, num_blocks: int, computed: ComputedBlocks) -> int:
        """Blocks missing to admit a request needing ``num_blocks`` that reuses
        ``computed`` (``<= 0``: it fits). A copied block is one of the request's own."""
        pool = self.pool
        available = pool.num_free - pool.num_evictable(computed.referenced) - self._reserved
        return num_blocks - len(computed.blocks) - available

    def allocate_request(
        self,
        prompt_keys: tuple[BlockKey, ...],
        num_prompt_tokens: int,
        params: SamplingParams,
        computed: ComputedBlocks,
    ) -> RequestBlocks | None:
        """Admit a request: reference ``computed`` and reserve the rest of its worst case,
        or ``None`` (and nothing changed) when that does not fit."""
        needed = self.blocks_needed(num_prompt_tokens, params)
        if self.shortage(needed, computed) > 0:
            return None
        pool = self.pool
        bs = self.block_size
        hit = computed.blocks
        last = num_prompt_tokens + params.max_tokens - 1
        pool.acquire(hit)
        prompt = SeqBlocks(prompt_keys, list(hit), list(prompt_keys[: len(hit)]))
        samples: tuple[SeqBlocks, ...] = ()
        if params.n == 1:
            prompt.reserved = pool.blocks_for(last) - len(hit)
        else:
            prompt.reserved = pool.blocks_for(num_prompt_tokens) - len(hit)
            per_child = pool.blocks_for(last) - num_prompt_tokens // bs
            samples = tuple(SeqBlocks(prompt_keys, reserved=per_child) for _ in range(params.n))
        self._reserved += prompt.reserved + sum(s.reserved for s in samples)
        if computed.partial is not None:
            # the copy's source is referenced first, so that allocate() cannot evict it; the
            # copy is the prompt's next block, from its reservation (at least the last
            # prompt token's block), which the free blocks cover (shortage above)
            pool.acquire((computed.partial,))
            copy = self.allocate_slots(prompt, len(hit) * bs + 1)
            assert copy, "admission counted the copy's block"
            self._copies.append((computed.partial, copy[0], prompt))
            self._copy_sources.append(computed.partial)
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += computed.num_tokens
        return RequestBlocks(prompt, samples, computed.num_tokens)

    # -- a running sequence -----------------------------------------------------------------

    def allocate_slots(self, seq: SeqBlocks, num_tokens: int) -> Sequence[int] | None:
        """Grow ``seq``'s table from its reservation until it covers ``num_tokens``
        positions: the blocks added, or ``None`` (nothing changed) past the reservation."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return _NO_NEW_BLOCKS
        if need > seq.reserved:
            return None
        blocks = self.pool.allocate(need)
        if blocks is None:
            return None
        seq.block_table.extend(blocks)
        seq.reserved -= need
        self._reserved -= need
        return blocks

    def truncate(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Give the blocks past ``seq``'s first ``num_tokens`` positions back to its
        reservation (the positions of drafts that verification rejected). They hold no
        computed tokens, so none of them is keyed or shared."""
        keep = self.pool.blocks_for(num_tokens)
        extra = seq.block_table[keep:]
        if not extra:
            return
        del seq.block_table[keep:]
        self.pool.free(extra)
        seq.reserved += len(extra)
        self._reserved += len(extra)

    def cache_blocks(self, seq: SeqBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        """Key the blocks of ``seq`` that became full (their KV is written once the step
        that computed them returned)."""
        bs = self.block_size
        keys = seq.block_keys
        prompt_keys = seq.prompt_keys
        for i in range(len(keys), num_computed // bs):
            parent = keys[i - 1] if i else None
            tokens = token_ids[i * bs : (i + 1) * bs]
            key = prompt_keys[i] if i < len(prompt_keys) else block_key(parent, tokens)
            self.pool.register(seq.block_table[i], key, parent, tokens)
            keys.append(key)

    def fork(self, parent: SeqBlocks, child: SeqBlocks, num_tokens: int) -> bool:
        """Give ``child`` the first ``num_tokens`` positions of ``parent``: full blocks
        shared, a partial last block copied (see :meth:`take_block_copies`). ``False``
        (nothing changed) when the copy does not fit the child's reservation."""
        if num_tokens % self.block_size and child.reserved < 1:
            return False
        forked = self.pool.fork(parent.block_table, num_tokens)
        if forked is None:
            return False
        child.block_table = list(forked.block_table)
        child.block_keys = list(parent.block_keys[: num_tokens // self.block_size])
        child.reserved -= len(forked.copies)
        self._reserved -= len(forked.copies)
        self._copies.extend((src, dst, child) for src, dst in forked.copies)
        return True

    def take_block_copies(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) copies the next plan runs: forks and prefix copies since the last
        call whose sequence still holds its blocks. Drops the prefix copies' references to
        their sources (see the module's docstring)."""
        if not self._copies:
            return ()
        live = tuple((src, dst) for src, dst, owner in self._copies if owner.block_table)
        self._copies.clear()
        if self._copy_sources:
            self.pool.free(self._copy_sources)
            self._copy_sources.clear()
        return live

    def free(self, seq: SeqBlocks) -> None:
        """Drop ``seq``'s blocks and what is left of its reservation. Idempotent."""
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        self._reserved -= seq.reserved
        seq.reserved = 0

    # -- pins -------------------------------------------------------------------------------

    def pin(self, seq: SeqBlocks, token_ids: Sequence[int], num_prompt_tokens: int) -> KeptKV:
        """Pin the cached blocks of what ``seq`` computed (its full, keyed blocks)."""
        blocks = self.pool.match(seq.block_keys)
        self.pool.acquire(blocks)
        num_tokens = len(blocks) * self.block_size
        return KeptKV(
            token_ids=tuple(token_ids[:num_tokens]),
            blocks=tuple(blocks),
            output_token_ids=tuple(token_ids[num_prompt_tokens:]),
        )

    def unpin(self, blocks: Iterable[int]) -> None:
        """Drop one pin of each block (of a :class:`KeptKV`, or a session's)."""
        self.pool.free(blocks)
