"""The refcounted KV block allocator."""

from __future__ import annotations

import pytest

from furnace_trio.engine.block_pool import BlockPool


def test_allocate_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    first = pool.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert (pool.num_used, pool.num_free) == (3, 1)
    assert pool.allocate(2) is None
    assert (pool.num_used, pool.num_free) == (3, 1)  # nothing taken
    assert pool.allocate(0) == []


def test_free_returns_blocks_and_refcounts_share() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.incref(blocks[:1])
    assert pool.refcount(blocks[0]) == 2
    pool.free(blocks)
    assert pool.num_free == 2  # blocks[0] is still referenced once
    pool.free(blocks[:1])
    assert pool.num_free == 3
    with pytest.raises(ValueError):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.incref(blocks[:1])


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    table = pool.allocate(3)
    assert table is not None
    fork = pool.fork(table, 10)  # 2 full blocks + 2 tokens in the third
    assert fork is not None
    assert fork.block_table[:2] == tuple(table[:2])
    assert fork.block_table[2] not in table
    assert fork.copies == ((table[2], fork.block_table[2]),)
    assert [pool.refcount(b) for b in table] == [2, 2, 1]
    assert pool.num_used == 4


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    table = pool.allocate(2)
    assert table is not None
    fork = pool.fork(table, 8)
    assert fork is not None and fork.copies == () and fork.block_table == tuple(table)
    assert pool.num_used == 2


def test_fork_without_room_changes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    table = pool.allocate(2)
    assert table is not None
    assert pool.fork(table, 6) is None
    assert [pool.refcount(b) for b in table] == [1, 1]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, block_size=4)
    pool = BlockPool(num_blocks=2, block_size=4)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        pool.fork([0], 5)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2
