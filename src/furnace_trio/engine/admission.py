"""Admission: the waiting queue, and the KV that its head gets when the scheduler admits it.

Requests wait first come first served in a :class:`WaitingQueue`. A request (its
:class:`~furnace_trio.engine.sequence.Group`) joins at the back
(:meth:`WaitingQueue.append`) and leaves from the front when it is admitted
(:meth:`WaitingQueue.popleft`), or from anywhere when it is aborted
(:meth:`WaitingQueue.remove`). The queue counts the samples of its requests (``n`` each):
what they will run as, and what the engine's ``max_waiting`` limits.

Prefix cache: at admission the prompt's cached prefix (never its last token) becomes the
start of the block table (shared full blocks, then a copied block whose first tokens it
shares) and of ``num_computed_tokens``, so only the rest is computed (:func:`allocate`).
A prompt whose tokens are scored (``prompt_logprobs``) is computed whole. :func:`start_running` then sets the admitted request's sequences running.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from furnace_trio.engine.kv_cache_manager import (
    NO_COMPUTED_BLOCKS,
    ComputedBlocks,
    KVCacheManager,
    RequestBlocks,
)
from furnace_trio.engine.sequence import Group, Seq, SeqStatus

__all__ = ["WaitingQueue", "allocate", "start_running"]


class WaitingQueue:
    """Waiting requests in arrival order, found by request id."""

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()
        self._by_id: dict[str, Group] = {}
        self._num_samples = 0

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)

    @property
    def num_samples(self) -> int:
        """Samples of the waiting requests (``n`` per request)."""
        return self._num_samples

    @property
    def head(self) -> Group:
        """The oldest request: the next to admit (``IndexError`` when empty)."""
        return self._groups[0]

    def has(self, request_id: str) -> bool:
        return request_id in self._by_id

    def append(self, group: Group) -> None:
        self._groups.append(group)
        self._by_id[group.request_id] = group
        self._num_samples += group.params.n

    def popleft(self) -> Group:
        """Take the head (it is being admitted)."""
        group = self._groups.popleft()
        del self._by_id[group.request_id]
        self._num_samples -= group.params.n
        return group

    def remove(self, request_id: str) -> Group | None:
        """Take a request out wherever it is; ``None`` if it is not waiting."""
        group = self._by_id.pop(request_id, None)
        if group is not None:
            self._groups.remove(group)
            self._num_samples -= group.params.n
        return group


def allocate(kv: KVCacheManager, group: Group) -> tuple[RequestBlocks | None, ComputedBlocks]:
    """The request's blocks (``None`` when the KV cache manager has no room for it) and its
    cached prefix (without its copied block when only that did not fit)."""
    computed = NO_COMPUTED_BLOCKS
    if group.params.prompt_logprobs is None:  # a scored prompt is computed whole
        computed = kv.get_computed_blocks(group.prompt_keys, group.prompt)
    blocks = kv.allocate_request(group.prompt_keys, len(group.prompt), group.params, computed)
    if blocks is None and computed.partial is not None:
        computed = kv.without_partial(computed)
        blocks = kv.allocate_request(group.prompt_keys, len(group.prompt), group.params, computed)
    return blocks, computed


def start_running(group: Group, blocks: RequestBlocks) -> list[Seq]:
    """Set an admitted request running on ``blocks``: its sequences, now running."""
    group.status = SeqStatus.RUNNING
    prefill = group.prefill
    assert prefill is not None
    prefill.kv = blocks.prompt
    prefill.num_computed_tokens = group.cached_tokens = blocks.num_cached_tokens
    seqs = [prefill]
    if blocks.samples:  # n > 1: the children's tables fill when they fork
        for child, child_kv in zip(group.samples, blocks.samples, strict=True):
            child.kv = child_kv
            seqs.append(child)
    for seq in seqs:
        seq.status = SeqStatus.RUNNING
    return seqs
