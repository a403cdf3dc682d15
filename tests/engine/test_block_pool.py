"""The refcounted KV block allocator."""

from __future__ import annotations

import pytest

from furnace_trio.engine.block_pool import PARTIAL_CANDIDATES, BlockPool, block_key


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


def test_partial_match_takes_the_candidate_sharing_the_most_tokens() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    parent = block_key(None, [1, 2, 3, 4])
    a, b, c = pool.allocate(3) or []
    assert pool.register(a, block_key(parent, [5, 6, 7, 8]), parent, [5, 6, 7, 8])
    assert pool.register(b, block_key(parent, [5, 6, 9, 9]), parent, [5, 6, 9, 9])
    assert pool.register(c, block_key(None, [5, 6, 7, 1]), None, [5, 6, 7, 1])  # a first block
    assert pool.match_partial(parent, [5, 6, 7, 0]) == (a, 3)
    assert pool.match_partial(parent, [5, 6, 9]) == (b, 3)  # at most the tokens asked
    assert pool.match_partial(parent, [5, 0]) in {(a, 1), (b, 1)}
    assert pool.match_partial(None, [5, 6, 7, 1, 4]) == (c, 4)  # at most a block
    assert pool.match_partial(parent, [6, 6]) is None  # no candidate starts with 6
    assert pool.match_partial(parent, []) is None
    pool.free([a, b, c])
    assert pool.match_partial(parent, [5, 6, 7]) == (a, 3)  # evictable blocks still count
    fresh = pool.allocate(8)  # evicts all three
    assert fresh is not None and pool.match_partial(parent, [5, 6]) is None
    assert pool.match_partial(None, [5, 6]) is None


def test_partial_candidates_are_bounded_and_unkeyed_blocks_are_not_candidates() -> None:
    pool = BlockPool(num_blocks=PARTIAL_CANDIDATES + 2, block_size=2)
    blocks = pool.allocate(PARTIAL_CANDIDATES + 1) or []
    for i, block in enumerate(blocks):
        assert pool.register(block, block_key(None, [7, i]), None, [7, i])
    # the oldest candidate was dropped from the index (it stays cached by its key)
    assert pool.match_partial(None, [7, 0]) == (blocks[1], 1)
    assert pool.match_partial(None, [7, PARTIAL_CANDIDATES]) == (blocks[-1], 2)
    assert pool.match([block_key(None, [7, 0])]) == [blocks[0]]
    (other,) = pool.allocate(1) or []
    assert pool.register(other, block_key(None, [8, 8]))  # no tokens given: no candidate
    assert pool.match_partial(None, [8, 8]) is None
