"""Verifying a step's drafts (speculative decoding): which rows a drafted chunk samples,
and which of the drawn tokens it keeps.

A drafted chunk (:attr:`~furnace_trio.core.plan.ChunkPlan.num_drafts`) samples at its last
real token and at every draft; each position draws as plain decoding would, with the drafts
before it counted as output. :func:`accept_drafts` then keeps the drawn tokens up to and
including the first that differs from the draft there.
"""

from __future__ import annotations

import dataclasses

from furnace_trio.core.plan import ChunkPlan, SampledToken, SampleSpec, StepPlan

__all__ = ["accept_drafts", "draft_specs"]


def draft_specs(chunk: ChunkPlan) -> list[SampleSpec]:
    """The sample specs of a chunk's draft positions: one per position from its last real
    token on, each with the drafts before it as output, so that penalties and the
    position's draw see the sequence as plain decoding would have had it there.

    A grammar-constrained sample's drafts are checked against its grammar first: the
    position of the first draft the grammar refuses draws under the grammar's mask there,
    so it never keeps that draft, and the positions after it draw without the constraint
    (verification stops before them; their grammar state would follow a refused token)."""
    spec = chunk.samples[0]
    drafts = chunk.draft_token_ids
    out = spec.output_token_ids
    specs = [
        dataclasses.replace(spec, output_token_ids=out + drafts[:i]) for i in range(len(drafts) + 1)
    ]
    constraint = spec.params.constraint
    if constraint is not None:
        valid = constraint.valid_drafts(spec.seq_id, out, drafts)
        if valid < len(drafts):
            free = dataclasses.replace(spec.params, constraint=None)
            for i in range(valid + 1, len(specs)):
                specs[i] = dataclasses.replace(specs[i], params=free)
    return specs


def accept_drafts(
    plan: StepPlan, sampled: list[SampledToken], *, proposed: bool = False
) -> list[SampledToken]:
    """The tokens of a step's samples with draft positions cut down to what verification
    keeps: for each drafted chunk the drawn tokens up to and including the first one that
    differs from its draft (all of them when every draft matched). ``proposed`` (the
    runner's draft model made the drafts): the first token of each drafted chunk carries
    them (:attr:`~furnace_trio.core.plan.SampledToken.proposed`).

    Each position's token was drawn from the model's distribution at that position given
    the drafts before it, independently. Keeping draft ``i`` exactly when the draw there
    equals it accepts it with probability ``p_i(draft)``, and the first differing draw is
    a sample of ``p_i`` without the draft, renormalized: the standard rejection rule for a
    deterministic proposal, so the tokens are distributed as plain decoding's. Greedy
    rows draw the argmax, so greedy output is plain decoding's token for token.
    """
    if not any(chunk.num_drafts for chunk in plan.chunks):
        return sampled
    out: list[SampledToken] = []
    at = 0
    for chunk in plan.chunks:
        rows = sampled[at : at + len(chunk.samples) + chunk.num_drafts]
        at += len(rows)
        if not chunk.num_drafts:
            out.extend(rows)
            continue
        kept = 1
        for token, draft in zip(rows, chunk.draft_token_ids, strict=False):
            if token.token_id != draft:
                break
            kept += 1
        if proposed:
            rows[0] = dataclasses.replace(rows[0], proposed=chunk.draft_token_ids)
        out.extend(rows[:kept])
    return out
