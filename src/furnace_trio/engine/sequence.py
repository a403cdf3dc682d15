"""The scheduler's records: a :class:`Seq` per sequence, a :class:`Group` per request.

As in vLLM v1, a sequence has ``token_ids`` (prompt, then output) and
``num_computed_tokens`` (how many of them are in the KV cache); there is no prefill or
decode phase. A request with ``n == 1`` is one sequence; with ``n > 1`` a prompt-only
parent runs the prompt once and ``n`` children sample from it. Plain mutable state owned
by the :class:`~furnace_trio.engine.scheduler.Scheduler`; each sequence's KV blocks are
the :class:`~furnace_trio.engine.kv_cache_manager.KVCacheManager`'s
(:class:`~furnace_trio.engine.kv_cache_manager.SeqBlocks`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine.block_pool import BlockKey
from furnace_trio.engine.kv_cache_manager import SeqBlocks
from furnace_trio.engine.speculation import DraftState

__all__ = ["Group", "Seq", "SeqStatus", "new_group"]


class SeqStatus(enum.Enum):
    """Where a sequence or request is: queued, admitted, or done (its KV freed)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Seq:
    """One sequence: a request's single sample, or the prompt-only parent of ``n > 1``.

    Invariants: ``num_computed_tokens <= len(token_ids)``; once admitted, ``kv.block_table``
    covers the first ``num_computed_tokens`` positions (the KV cache manager owns ``kv``).
    """

    seq_id: int
    group: Group
    index: int | None  # sample index; None for the parent of n > 1
    params: SamplingParams
    token_ids: list[int]
    kv: SeqBlocks
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    draft: DraftState | None = None  # speculative decoding's state, once it drafted

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.group.prompt)


@dataclass(slots=True, eq=False)
class Group:
    """One request: its prompt sequence and its ``n`` samples (the same sequence if n == 1)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    blocks_needed: int
    prefill: Seq | None = None  # None once the prompt ran and the children forked
    samples: list[Seq] = field(default_factory=list)
    num_live: int = 0  # samples not finished
    status: SeqStatus = SeqStatus.WAITING
    prompt_keys: tuple[BlockKey, ...] = ()  # chain keys of the prompt's full blocks
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    keep_kv: bool = False
    paused: bool = False  # running, but takes no steps (its client stopped reading)


def new_group(
    request_id: str,
    prompt: tuple[int, ...],
    params: SamplingParams,
    blocks_needed: int,
    prompt_keys: tuple[BlockKey, ...],
    first_seq_id: int,
) -> Group:
    """A queued request's records: one sequence for ``n == 1``; for ``n > 1`` a prompt
    parent and ``n`` samples (``seed + index`` when seeded, so that they differ). Seq ids
    count up from ``first_seq_id`` (``n``, or ``n + 1`` of them, are taken)."""
    group = Group(request_id, prompt, params, blocks_needed, prompt_keys=prompt_keys)
    ids = iter(range(first_seq_id, first_seq_id + params.n + 1))

    def seq(index: int | None, seq_params: SamplingParams) -> Seq:
        # no KV blocks until admitted
        return Seq(next(ids), group, index, seq_params, list(prompt), SeqBlocks(prompt_keys))

    if params.n == 1:
        group.prefill = seq(0, params)
        group.samples = [group.prefill]
    else:
        group.prefill = seq(None, params)
        for i in range(params.n):
            child = params
            if params.seed is not None:
                child = dataclasses.replace(params, seed=params.seed + i)
            group.samples.append(seq(i, child))
    group.num_live = params.n
    return group
