"""Admission on its own: the waiting queue's order and counts, and the KV a queue head gets
(its cached prefix, its reservation, its sequences set running). Plain Python."""

from __future__ import annotations

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine.admission import WaitingQueue, allocate, start_running
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.sequence import Group, SeqStatus, new_group


def group(kv: KVCacheManager, request_id: str, prompt: tuple[int, ...], **params: object) -> Group:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    needed = kv.blocks_needed(len(prompt), sampling)
    return new_group(request_id, prompt, sampling, needed, kv.prompt_keys(prompt), 0)


def test_the_queue_keeps_arrival_order_and_counts_samples() -> None:
    kv = KVCacheManager(BlockPool(32, 4))
    queue = WaitingQueue()
    a, b, c = (group(kv, "abc"[i], (1, 2, 3), n=n, max_tokens=4) for i, n in enumerate((1, 3, 2)))
    for g in (a, b, c):
        queue.append(g)
    assert [g.request_id for g in queue] == ["a", "b", "c"]
    assert (len(queue), queue.num_samples, queue.head) == (3, 6, a)
    assert queue.remove("b") is b and queue.remove("b") is None
    assert not queue.has("b") and queue.has("c")
    assert queue.popleft() is a
    assert (len(queue), queue.num_samples, queue.head) == (1, 2, c)


def test_a_head_gets_its_cached_prefix_unless_its_prompt_is_scored() -> None:
    kv = KVCacheManager(BlockPool(32, 4))
    prompt = tuple(range(1, 11))  # two full blocks and a partial one
    first = group(kv, "first", prompt, max_tokens=4)
    blocks, _ = allocate(kv, first)
    assert blocks is not None and blocks.num_cached_tokens == 0
    seqs = start_running(first, blocks)
    assert seqs == [first.prefill] and first.status is SeqStatus.RUNNING
    seq = seqs[0]
    assert kv.allocate_slots(seq.kv, len(prompt)) is not None
    kv.cache_blocks(seq.kv, seq.token_ids, len(prompt))

    again = group(kv, "again", prompt, max_tokens=4)
    blocks, computed = allocate(kv, again)
    assert blocks is not None and blocks.num_cached_tokens == computed.num_tokens == 8
    start_running(again, blocks)
    assert again.cached_tokens == 8 and again.prefill is not None
    assert again.prefill.num_computed_tokens == 8

    scored = group(kv, "scored", prompt, max_tokens=4, prompt_logprobs=1)
    blocks, computed = allocate(kv, scored)
    assert blocks is not None and blocks.num_cached_tokens == computed.num_tokens == 0


def test_n_children_get_their_own_tables_and_run_with_the_parent() -> None:
    kv = KVCacheManager(BlockPool(32, 4))
    parent = group(kv, "p", (1, 2, 3, 4, 5), n=3, max_tokens=4)
    blocks, _ = allocate(kv, parent)
    assert blocks is not None and len(blocks.samples) == 3
    seqs = start_running(parent, blocks)
    assert seqs == [parent.prefill, *parent.samples]
    assert all(seq.status is SeqStatus.RUNNING for seq in seqs)
    assert [seq.kv for seq in parent.samples] == list(blocks.samples)


def test_a_head_that_does_not_fit_gets_no_blocks() -> None:
    kv = KVCacheManager(BlockPool(4, 4))
    big = group(kv, "big", tuple(range(1, 13)), max_tokens=12)  # 6 blocks, the pool has 4
    blocks, _ = allocate(kv, big)
    assert blocks is None and big.status is SeqStatus.WAITING
