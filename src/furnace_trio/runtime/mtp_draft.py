"""Drafts from the model's own multi-token-prediction layer (``FURNACE_SPECULATIVE=mtp``).

The engine decides which sequences draft and how many positions, as for a draft model
(their drafts arrive as placeholders); this :class:`~.draft.Drafter` fills them from the
served model's MTP layer (:mod:`.mtp`). The layer at position ``j`` needs the decoder's
hidden state there and the token at ``j + 1``, so it runs after each step's verification,
on every position the step verified, and keeps the last one's output for the next step::

    step n      chunk [d x y]          d: last token; x y: drafts; x held, y did not
                decoder -> h_d h_x     (h_y is dropped with y)
                returned  x z          z: the model's own token after x
    observe     MTP (h_d, x) at d's position, (h_x, z) at x's -> keeps out_x
    step n + 1  lm_head(out_x) -> a             the first draft, the token after z
                MTP (out_x, a) -> lm_head -> b  further drafts: the layer fed its own output
                chunk [z a b]

So the layer's cache holds, at every position a sequence has verified, what the layer
computes there, and a prompt's positions are filled by the steps that compute the prompt
(a chunk's last position waits for the next chunk's first token). A second draft and more
come from the one layer fed its own output at the next position (as vLLM runs a model
with fewer MTP layers than drafts): MiMo trains one layer to predict one token ahead, so
those drafts hold less often, and the engine's per-sequence draft length follows what
holds. The keys and values those extra drafts write lie past the verified positions and
are written over by the next step's pass before any row reads them.

What it costs: the MTP layer (about one decoder layer) on every token a step verifies,
prompts included, and the LM head once per draft. Nothing of it changes the served
model's output: drafts are verified as any others.

Where a sequence has nothing kept (a forked ``n > 1`` sample's first decode, a prompt
whose last blocks came from the prefix cache before this layer ran on them), its
placeholders stay and verification rejects them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from furnace_trio.core.plan import ChunkPlan, SampledToken, StepPlan
from furnace_trio.runtime.step_inputs import build_inputs

if TYPE_CHECKING:
    from furnace_trio.runtime.runner import ModelRunner

__all__ = ["MTPDrafter"]

#: Rows of one pass: as many as a long prompt step verifies (one-token rows, each a row of
#: the decode-attention kernel), enough for any step.
_SPLIT = 1 << 30


@dataclass(frozen=True, slots=True)
class _Waiting:
    """A decoder hidden state whose next token the step did not know (a prompt chunk's
    last position): the MTP layer runs it with the next chunk's first token."""

    position: int
    hidden: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Ready:
    """The MTP layer's output at ``position``, run with ``token`` at ``position + 1``:
    its logits give the first draft of a chunk that starts with ``token`` there."""

    position: int
    token: int
    out: torch.Tensor


class MTPDrafter:
    """Proposals of the served model's multi-token-prediction layer; a
    :class:`~.draft.Drafter` (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        model = runner.model
        if model.mtp is None or runner.mtp_cache is None:
            raise ValueError("the runner was built without its multi-token-prediction layer")
        self._runner = runner
        self._cache = runner.mtp_cache
        model.capture_hidden = True
        self._waiting: dict[int, _Waiting] = {}
        self._ready: dict[int, _Ready] = {}

    @property
    def num_sequences(self) -> int:
        """Sequences with something kept for their next step."""
        return len(self._waiting.keys() | self._ready.keys())

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._waiting.pop(seq_id, None)
            self._ready.pop(seq_id, None)

    def fill(self, plan: StepPlan) -> StepPlan:
        """``plan`` with the drafts of every drafted chunk whose sequence has an output
        kept for it replaced by the layer's greedy proposals."""
        jobs: list[ChunkPlan] = []
        outs: list[torch.Tensor] = []
        for chunk in plan.chunks:
            ready = self._ready.get(chunk.seq_id)
            if (
                chunk.num_drafts
                and len(chunk.samples) == 1
                and ready is not None
                and ready.position + 1 == chunk.start_pos
                and ready.token == chunk.token_ids[0]
            ):
                jobs.append(chunk)
                outs.append(ready.out)
        if not jobs:
            return plan
        model = self._runner.model
        proposals: dict[int, list[int]] = {chunk.seq_id: [] for chunk in jobs}
        with torch.inference_mode():
            out = torch.stack(outs)
            while jobs:
                drafts = model.lm_head(out).argmax(dim=-1).tolist()
                for chunk, token in zip(jobs, drafts, strict=True):
                    proposals[chunk.seq_id].append(token)
                more = [i for i, c in enumerate(jobs) if len(proposals[c.seq_id]) < c.num_drafts]
                if not more:
                    break
                jobs = [jobs[i] for i in more]
                rows = [_next_row(c, proposals[c.seq_id]) for c in jobs]
                out = self._run(out[more], rows)
        return plan.with_drafts(proposals)

    def observe(self, plan: StepPlan, tokens: Sequence[SampledToken]) -> None:
        """Run the layer on every position ``plan`` verified (see the module docstring)."""
        model = self._runner.model
        if model.hidden is None:
            return
        returned: dict[int, list[int]] = {}  # by sample: its tokens, the accepted drafts first
        for sampled in tokens:
            returned.setdefault(sampled.seq_id, []).append(sampled.token_id)
        rows: list[ChunkPlan] = []
        step_rows: list[int] = []  # rows of the step's hidden states the pass reads, in order
        kept: dict[int, torch.Tensor] = {}  # seq id -> its waiting hidden state, first row
        finals: list[tuple[int, int, int]] = []  # seq id, its last row in the pass, token
        waits: list[tuple[int, int, int]] = []  # seq id, its last position, row of the step
        offset = 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            waiting = self._waiting.pop(chunk.seq_id, None)
            self._ready.pop(chunk.seq_id, None)
            # the token after each position the step verified: the chunk's own tokens after
            # its first real one, then what the step drew (the accepted drafts and one more)
            nexts = list(chunk.token_ids[1 : n - chunk.num_drafts])
            if len(chunk.samples) == 1:
                nexts += returned[chunk.samples[0].seq_id]
            elif not chunk.samples:  # a prompt chunk's last position waits
                waits.append((chunk.seq_id, chunk.start_pos + n - 1, offset + n - 1))
            start = chunk.start_pos
            if waiting is not None and waiting.position + 1 == start:
                start -= 1
                nexts.insert(0, chunk.token_ids[0])
                kept[chunk.seq_id] = waiting.hidden
            step_rows.extend(range(offset, offset + len(nexts) - (chunk.seq_id in kept)))
            if nexts:
                rows.append(ChunkPlan(chunk.seq_id, tuple(nexts), start, chunk.block_table))
                if len(chunk.samples) == 1:
                    finals.append((chunk.seq_id, len(rows) - 1, nexts[-1]))
            offset += n
        with torch.inference_mode():
            wait_rows = [row for *_, row in waits]
            device = self._runner.device
            index = torch.tensor(step_rows + wait_rows, dtype=torch.int64, device=device)
            normed = model.final_hidden(index) if len(index) else model.hidden[:0]
            for (seq_id, position, _), h in zip(waits, normed[len(step_rows) :], strict=True):
                self._waiting[seq_id] = _Waiting(position, h.clone())
            if not rows:
                return
            parts, at = [], 0
            for row in rows:
                count = len(row.token_ids)
                if row.seq_id in kept:
                    parts.append(kept[row.seq_id][None])
                    count -= 1
                parts.append(normed[at : at + count])
                at += count
            out = self._run(torch.cat(parts), rows)
            ends = list(itertools.accumulate(len(row.token_ids) for row in rows))
            for seq_id, which, token in finals:
                position = rows[which].start_pos + len(rows[which].token_ids) - 1
                self._ready[seq_id] = _Ready(position, token, out[ends[which] - 1].clone())

    def _run(self, hidden: torch.Tensor, rows: Sequence[ChunkPlan]) -> torch.Tensor:
        """The layer over ``rows`` (their tokens are the next tokens) from ``hidden``."""
        inputs = build_inputs(
            StepPlan(tuple(rows)),
            self._cache.block_size,
            self._runner.device,
            all_rows=True,
            split_upto=_SPLIT,
        )
        return self._runner.model.mtp_forward(hidden, inputs, self._cache)


def _next_row(chunk: ChunkPlan, drafts: Sequence[int]) -> ChunkPlan:
    """The layer's row that proposes the draft after ``drafts``: the last of them at the
    position before its own (the first draft's position is the chunk's second)."""
    return ChunkPlan(
        chunk.seq_id, (drafts[-1],), chunk.start_pos + len(drafts) - 1, chunk.block_table
    )
