"""The KV cache manager on its own: admit or refuse, prefix match, grow, fork, free, pin.
Plain Python over a small pool."""

from __future__ import annotations

from typing import Any

import pytest

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.kv_cache_manager import NO_COMPUTED_BLOCKS, KVCacheManager, RequestBlocks


def make(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size))


def admit(kv: KVCacheManager, prompt: list[int], **params: Any) -> RequestBlocks | None:
    p = SamplingParams(**params)
    keys = kv.prompt_keys(prompt)
    computed = kv.get_computed_blocks(keys, prompt)
    return kv.allocate_request(keys, len(prompt), p, computed)


def test_admission_reserves_the_worst_case_or_refuses_changing_nothing() -> None:
    kv = make()
    first = admit(kv, [1] * 6, max_tokens=7)  # 12 positions: 3 blocks
    assert first is not None and first.prompt.reserved == 3 and kv.num_reserved == 3
    assert kv.pool.num_used == 0  # reserved, not yet written
    assert admit(kv, [2] * 9, max_tokens=13) is None  # 21 positions: 6 > 8 - 3
    assert kv.num_reserved == 3 and kv.pool.num_used == 0
    assert kv.shortage(5, NO_COMPUTED_BLOCKS) == 0  # exactly fits
    assert kv.shortage(6, NO_COMPUTED_BLOCKS) == 1


def test_allocate_slots_grows_from_the_reservation_only() -> None:
    kv = make()
    blocks = admit(kv, [1] * 6, max_tokens=3)  # 8 positions: 2 blocks
    assert blocks is not None
    seq = blocks.prompt
    assert kv.allocate_slots(seq, 6) is not None and len(seq.block_table) == 2
    assert kv.allocate_slots(seq, 8) == ()  # the table covers it already
    assert kv.num_reserved == 0 and kv.pool.num_used == 2
    assert kv.allocate_slots(seq, 9) is None  # past the reservation: no
    assert len(seq.block_table) == 2


def test_free_returns_blocks_and_the_rest_of_the_reservation() -> None:
    kv = make()
    blocks = admit(kv, [1] * 3, max_tokens=10)
    assert blocks is not None
    kv.allocate_slots(blocks.prompt, 3)
    assert kv.pool.num_used == 1 and kv.num_reserved == 2
    kv.free(blocks.prompt)
    kv.free(blocks.prompt)  # idempotent
    assert kv.pool.num_used == 0 and kv.num_reserved == 0


def test_prefix_match_reuses_full_blocks_short_of_the_last_token() -> None:
    kv = make(num_blocks=16)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    first = admit(kv, prompt, max_tokens=2)
    assert first is not None and first.num_cached_tokens == 0
    kv.allocate_slots(first.prompt, 10)
    kv.cache_blocks(first.prompt, prompt, 10)
    table = list(first.prompt.block_table)
    kv.free(first.prompt)
    assert kv.pool.num_cached == 2
    second = admit(kv, prompt, max_tokens=2)
    assert second is not None and second.num_cached_tokens == 8
    assert len(second.prompt.block_table) == 2
    assert second.prompt.reserved == 1  # 11 positions: 3 blocks, 2 of them reused
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)
    # a prompt of exactly two blocks shares the first and copies 3 tokens of the second:
    # its last token is computed
    keys = kv.prompt_keys(prompt[:8])
    computed = kv.get_computed_blocks(keys, prompt[:8])
    assert computed.blocks == (table[0],)
    assert computed.partial == table[1] and computed.num_tokens == 7


def test_revived_cached_blocks_count_against_admission() -> None:
    kv = make(num_blocks=4, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    first = admit(kv, prompt, max_tokens=1)
    assert first is not None
    kv.allocate_slots(first.prompt, 13)
    kv.cache_blocks(first.prompt, prompt, 13)
    kv.free(first.prompt)
    keys = kv.prompt_keys(prompt)
    computed = kv.get_computed_blocks(keys, prompt)
    assert len(computed.blocks) == 3
    # 4 blocks needed, 3 reused: the one more must come from the free list, not the
    # cached blocks being revived
    assert kv.shortage(4, computed) == 0
    assert kv.allocate_request(keys, 13, SamplingParams(max_tokens=4), computed) is not None
    assert kv.pool.num_free == 1 and kv.num_reserved == 1


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = make(num_blocks=16)
    blocks = admit(kv, [1, 2, 3, 4, 5, 6], max_tokens=4, n=2)
    assert blocks is not None and len(blocks.samples) == 2
    parent = blocks.prompt
    kv.allocate_slots(parent, 6)
    full, partial = parent.block_table
    for child in blocks.samples:
        assert kv.fork(parent, child, 6)
    kv.free(parent)
    copies = kv.take_block_copies()
    assert len(copies) == 2 and {src for src, _ in copies} == {partial}
    assert kv.pool.refcount(full) == 2 and kv.pool.refcount(partial) == 0
    assert kv.take_block_copies() == ()  # handed out once


def test_a_freed_childs_copy_is_dropped() -> None:
    kv = make(num_blocks=16)
    blocks = admit(kv, [1, 2, 3, 4, 5, 6], max_tokens=4, n=2)
    assert blocks is not None
    kv.allocate_slots(blocks.prompt, 6)
    first, second = blocks.samples
    assert kv.fork(blocks.prompt, first, 6) and kv.fork(blocks.prompt, second, 6)
    kv.free(first)
    assert [dst for _, dst in kv.take_block_copies()] == [second.block_table[-1]]


def test_fork_without_room_for_the_copy_says_no() -> None:
    kv = make(num_blocks=16)
    blocks = admit(kv, [1, 2, 3, 4, 5, 6], max_tokens=1, n=2)  # children write nothing
    assert blocks is not None
    kv.allocate_slots(blocks.prompt, 6)
    child = blocks.samples[0]
    child.reserved = 0
    assert not kv.fork(blocks.prompt, child, 6)
    assert child.block_table == [] and kv.take_block_copies() == ()


def test_pins_hold_cached_blocks_until_unpinned() -> None:
    kv = make(num_blocks=8)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    blocks = admit(kv, tokens[:5], max_tokens=5)
    assert blocks is not None
    seq = blocks.prompt
    kv.allocate_slots(seq, 9)
    kv.cache_blocks(seq, tokens, 9)
    kept = kv.pin(seq, tokens, 5)
    assert kept.token_ids == tuple(tokens[:8]) and len(kept.blocks) == 2
    assert kept.output_token_ids == (6, 7, 8, 9)
    kv.free(seq)
    assert kv.pool.num_used == 2  # the pins
    kv.unpin(kept.blocks)
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2


def test_blocks_needed_shares_the_prompt_between_samples() -> None:
    kv = make(block_size=4)
    assert kv.blocks_needed(6, SamplingParams(max_tokens=3)) == 2
    # the prompt's 2 blocks, then per child: blocks_for(6 + 3 - 1) - 1 full prompt block
    assert kv.blocks_needed(6, SamplingParams(max_tokens=3, n=3)) == 2 + 3 * 1


@pytest.mark.parametrize("n", [1, 3])
def test_admission_then_free_leaves_nothing_behind(n: int) -> None:
    kv = make(num_blocks=32)
    blocks = admit(kv, list(range(1, 8)), max_tokens=6, n=n)
    assert blocks is not None
    kv.allocate_slots(blocks.prompt, 7)
    for child in blocks.samples:
        kv.fork(blocks.prompt, child, 7)
        kv.allocate_slots(child, 9)
    for seq in (blocks.prompt, *blocks.samples):
        kv.free(seq)
    assert kv.pool.num_used == 0 and kv.num_reserved == 0
