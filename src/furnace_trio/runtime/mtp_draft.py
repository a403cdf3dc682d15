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
        rows: list[ChunkPlan] = []
        sources: list[torch.Tensor | int] = []  # a kept hidden state, or a row of the step
        finals: list[tuple[int, int, int, int]] = []  # seq id, its last row, position, token
        waits: list[tuple[int, int, int]] = []  # seq id, position, row of the step
        at = offset = 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            returned = _returned(chunk, tokens[at:])
            at += len(returned)
            waiting = self._waiting.pop(chunk.seq_id, None)
            self._ready.pop(chunk.seq_id, None)
            nexts = list(chunk.token_ids[1:])  # the token after each position
            if chunk.num_drafts:  # verified: as many positions as tokens returned
                nexts = [t.token_id for t in returned]
            elif len(chunk.samples) == 1:
                nexts.append(returned[0].token_id)
            elif not chunk.samples:  # a prompt chunk's last position waits
                waits.append((chunk.seq_id, chunk.start_pos + n - 1, offset + n - 1))
            start = chunk.start_pos
            here: list[torch.Tensor | int] = list(range(offset, offset + len(nexts)))
            if waiting is not None and waiting.position + 1 == start:
                start -= 1
                nexts.insert(0, chunk.token_ids[0])
                here.insert(0, waiting.hidden)
            if nexts:
                rows.append(ChunkPlan(chunk.seq_id, tuple(nexts), start, chunk.block_table))
                sources.extend(here)
                if len(chunk.samples) == 1:
                    last = start + len(nexts) - 1
                    finals.append((chunk.seq_id, len(sources) - 1, last, nexts[-1]))
            offset += n
        with torch.inference_mode():
            step_rows = [s for s in sources if isinstance(s, int)] + [row for *_, row in waits]
            index = torch.tensor(step_rows, dtype=torch.int64, device=self._runner.device)
            normed = model.final_hidden(index) if step_rows else model.hidden[:0]
            at_row = {row: i for i, row in enumerate(step_rows)}
            for seq_id, position, row in waits:
                self._waiting[seq_id] = _Waiting(position, normed[at_row[row]].clone())
            if not rows:
                return
            hidden = _gather(normed, [at_row[s] if isinstance(s, int) else s for s in sources])
            out = self._run(hidden, rows)
            for seq_id, row, position, token in finals:
                self._ready[seq_id] = _Ready(position, token, out[row].clone())

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


def _gather(normed: torch.Tensor, sources: Sequence[torch.Tensor | int]) -> torch.Tensor:
    """Rows of ``normed`` (by index) and kept hidden states, in the order of ``sources``."""
    kept = [s for s in sources if not isinstance(s, int)]
    if not kept:
        order = [s for s in sources if isinstance(s, int)]
        if order == list(range(len(order))):
            return normed[: len(order)]
        return normed.index_select(0, torch.tensor(order, device=normed.device))
    table = torch.cat((normed, torch.stack(kept)))
    order, k = [], normed.shape[0]
    for s in sources:
        if isinstance(s, int):
            order.append(s)
        else:
            order.append(k)
            k += 1
    return table.index_select(0, torch.tensor(order, device=normed.device))


def _returned(chunk: ChunkPlan, tokens: Sequence[SampledToken]) -> list[SampledToken]:
    """The tokens the step returned for ``chunk``, from the front of ``tokens``."""
    if not chunk.num_drafts:
        return list(tokens[: len(chunk.samples)])
    kept = 1
    for token, draft in zip(tokens, chunk.draft_token_ids, strict=False):
        if token.token_id != draft:
            break
        kept += 1
    return list(tokens[:kept])


def _next_row(chunk: ChunkPlan, drafts: Sequence[int]) -> ChunkPlan:
    """The layer's row that proposes the draft after ``drafts``: the last of them at the
    position before its own (the first draft's position is the chunk's second)."""
    return ChunkPlan(
        chunk.seq_id, (drafts[-1],), chunk.start_pos + len(drafts) - 1, chunk.block_table
    )
