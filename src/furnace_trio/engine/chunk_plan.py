"""A sequence's chunk of a step: the :class:`~furnace_trio.core.plan.ChunkPlan` for its next tokens.

The scheduler decides how many tokens a sequence runs (a decode's one token, a prompt
chunk) and which drafts follow it; :func:`plan_chunk` grows the sequence's KV blocks to
cover them and describes the chunk for the runner: the tokens and their first position,
the block table, the samples drawn when the chunk reaches the end of the sequence's
tokens (one, or each live child of an ``n > 1`` parent), and the prompt tokens scored
when the request asks for ``prompt_logprobs``.
"""

from __future__ import annotations

from furnace_trio.core.plan import ChunkPlan, SampleSpec
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.sequence import Seq, SeqStatus

__all__ = ["plan_chunk"]


def plan_chunk(
    kv: KVCacheManager, seq: Seq, num_tokens: int, drafts: tuple[int, ...] = ()
) -> ChunkPlan:
    """The chunk running ``num_tokens`` of ``seq`` from its first uncomputed one, then
    ``drafts``; its KV slots are allocated from the request's reservation."""
    start = seq.num_computed_tokens
    end = start + num_tokens
    if kv.allocate_slots(seq.kv, end + len(drafts)) is None:
        raise RuntimeError(f"seq {seq.seq_id} outgrew its KV reservation (a scheduler bug)")
    group = seq.group
    samples: tuple[SampleSpec, ...] = ()
    if end == len(seq.token_ids):
        targets = [seq] if seq.index is not None else group.samples
        samples = tuple(
            SampleSpec(
                seq_id=s.seq_id,
                params=s.params,
                prompt_token_ids=group.prompt,
                output_token_ids=tuple(s.token_ids[len(group.prompt) :]),
            )
            for s in targets
            if s.status is SeqStatus.RUNNING
        )
    top = group.params.prompt_logprobs
    prompt = group.prompt
    return ChunkPlan(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.token_ids[start:end]) + drafts,
        start_pos=start,
        block_table=tuple(seq.kv.block_table),
        samples=samples,
        score_ids=() if top is None else prompt[start + 1 : min(end + 1, len(prompt))],
        score_top=top or 0,
        num_drafts=len(drafts),
    )
