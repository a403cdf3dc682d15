"""A draft model for speculative decoding (``FURNACE_SPECULATIVE=draft:<path>``).

The engine decides which sequences draft and how many positions (it reserves the served
model's KV for them); their drafts arrive as placeholders. Inside the runner's step, before
the verifying forward pass, :meth:`DraftModel.fill` proposes each drafting sequence's next
``k`` tokens greedily with a smaller model of the same vocabulary, batched over the
drafting sequences, and puts them in place of the placeholders::

    sequence    p p p p o o [d]           d: the last token; the draft's cache holds p p p p o
    catch up    [o d]   -> x1             every token its cache lacks, the last always
    decode      [x1]    -> x2             k - 1 one-token steps, batched over sequences
                [x2]    -> x3
    verify      [d x1 x2 x3]              the served model's chunk, as with any drafts

The draft model has a paged KV cache of its own (its own
:class:`~furnace_trio.runtime.runner.ModelRunner`), with block tables kept here per
sequence. After a step the draft's cache holds the sequence and the drafts fed to it
(``x1 .. x(k-1)``); the next step keeps what still agrees with the sequence (the accepted
drafts) and overwrites the rest, so the draft's KV is truncated to the accepted length
without a pass of its own. A sequence's blocks go back to the pool when the engine releases
it (its end, or cancellation: :attr:`~furnace_trio.core.plan.StepPlan.released`); when the
pool runs short, the sequences that drafted least recently lose theirs (they catch up again
from the prompt if they draft later). Nothing of the draft's cache is ever shared with the
served model's, whose prefix cache sees only verified tokens.

A sequence that the draft model cannot take (longer than its context, or a pool too small
for it) keeps its placeholders, which verification treats as any other drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from furnace_trio.core.plan import ChunkPlan, SampledToken, StepPlan
from furnace_trio.core.tokens import common_prefix
from furnace_trio.loading.model_config import UnsupportedModelError

if TYPE_CHECKING:
    from furnace_trio.loading.loader import LoadedModel
    from furnace_trio.runtime.runner import ModelRunner

__all__ = ["DraftModel", "Drafter", "check_vocabulary"]

logger = logging.getLogger(__name__)

#: The most tokens of one sequence a catch-up pass of the draft model runs (a prompt's
#: first: bounds the pass's activations, as the engine's step budget bounds a prefill).
CATCH_UP_TOKENS = 512


class Drafter(Protocol):
    """What a runner asks of a draft source that runs on the model thread."""

    def fill(self, plan: StepPlan) -> StepPlan:
        """``plan`` with the drafts of its drafted chunks replaced by proposals."""
        ...

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget what is kept for these sequences (they ended)."""
        ...

    def observe(self, plan: StepPlan, tokens: Sequence[SampledToken]) -> None:
        """After ``plan``'s forward pass: the tokens the step returned (verified)."""
        ...


@dataclass(slots=True, eq=False)
class _Cached:
    """One sequence in the draft's cache: its tokens at positions ``0 ..``, and the
    blocks holding them."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    keep: int = 0  # this step: the tokens in the cache that agree with the sequence


class DraftModel:
    """Greedy proposals of a draft model (see the module docstring); a :class:`Drafter`.

    ``vocab_size``: the served model's logit width; proposals are ids below it.
    """

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.vocab_size = min(vocab_size, runner.config.vocab_size)
        self._free = list(range(runner.num_blocks))
        self._seqs: dict[int, _Cached] = {}  # least recently drafted first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_sequences(self) -> int:
        """Sequences with tokens in the draft's cache."""
        return len(self._seqs)

    def observe(self, plan: StepPlan, tokens: Sequence[SampledToken]) -> None:
        """Nothing: the draft model catches up from each sequence's tokens in :meth:`fill`."""

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            cached = self._seqs.pop(seq_id, None)
            if cached is not None:
                self._free.extend(cached.blocks)

    def fill(self, plan: StepPlan) -> StepPlan:
        jobs = [c for c in plan.chunks if c.num_drafts and len(c.samples) == 1]
        if not jobs:
            return plan
        active = {c.seq_id for c in jobs}
        try:
            return self._fill(plan, jobs, active)
        except BaseException:
            self.release(active)  # their tokens may not all have reached the cache
            raise

    def _fill(self, plan: StepPlan, jobs: list[ChunkPlan], active: set[int]) -> StepPlan:
        catch_up: list[ChunkPlan] = []
        wanted: dict[int, int] = {}
        for chunk in jobs:
            spec = chunk.samples[0]
            context = spec.prompt_token_ids + spec.output_token_ids
            cached = self._cached(chunk.seq_id, context, chunk.num_drafts, active)
            if cached is None:
                continue
            keep = cached.keep
            del cached.tokens[keep:]
            cached.tokens.extend(context[keep:])
            table = tuple(cached.blocks)
            catch_up.append(ChunkPlan(chunk.seq_id, context[keep:], keep, table))
            wanted[chunk.seq_id] = chunk.num_drafts
        if not catch_up:
            return plan
        # a long catch-up (a prompt) runs its leading tokens a bounded piece at a time
        while any(len(c.token_ids) > CATCH_UP_TOKENS for c in catch_up):
            pieces = [_head(c) for c in catch_up if len(c.token_ids) > CATCH_UP_TOKENS]
            self.runner.logits(StepPlan(tuple(pieces)))
            catch_up = [_tail(c) if len(c.token_ids) > CATCH_UP_TOKENS else c for c in catch_up]
        proposals: dict[int, list[int]] = {c.seq_id: [] for c in catch_up}
        chunks = catch_up
        while chunks:
            for chunk, token in zip(chunks, self._argmax(StepPlan(tuple(chunks))), strict=True):
                proposals[chunk.seq_id].append(token)
            chunks = []
            for seq_id, drafts in proposals.items():
                if len(drafts) < wanted[seq_id]:
                    cached = self._seqs[seq_id]
                    at = len(cached.tokens)
                    cached.tokens.append(drafts[-1])
                    chunks.append(ChunkPlan(seq_id, (drafts[-1],), at, tuple(cached.blocks)))
        return plan.with_drafts(proposals)

    def _argmax(self, plan: StepPlan) -> list[int]:
        logits = self.runner.logits(plan)
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()

    def _cached(
        self, seq_id: int, context: Sequence[int], k: int, active: set[int]
    ) -> _Cached | None:
        """The sequence's entry, most recently used, with blocks for ``context`` and the
        ``k - 1`` drafts fed after it; ``None`` when the draft model cannot take it."""
        positions = len(context) + k - 1
        if positions > self.runner.max_context:
            return None
        cached = self._seqs.pop(seq_id, None) or _Cached()
        self._seqs[seq_id] = cached
        # the last token runs again whatever the cache holds: its logits give the first draft
        cached.keep = min(common_prefix(cached.tokens, context), len(context) - 1)
        if any(t >= self.vocab_size for t in context[cached.keep :]):
            return None  # a token the draft model has no embedding for
        need = -(-positions // self.block_size) - len(cached.blocks)
        while need > len(self._free):
            victim = next((s for s in self._seqs if s not in active), None)
            if victim is None:
                logger.debug("draft: no room for seq %d (%d positions)", seq_id, positions)
                return None
            self.release((victim,))
        for _ in range(need):
            cached.blocks.append(self._free.pop())
        return cached


def _head(chunk: ChunkPlan) -> ChunkPlan:
    return dataclasses.replace(chunk, token_ids=chunk.token_ids[:CATCH_UP_TOKENS])


def _tail(chunk: ChunkPlan) -> ChunkPlan:
    return dataclasses.replace(
        chunk,
        token_ids=chunk.token_ids[CATCH_UP_TOKENS:],
        start_pos=chunk.start_pos + CATCH_UP_TOKENS,
    )


def check_vocabulary(served: LoadedModel, draft: LoadedModel) -> None:
    """Raise :class:`UnsupportedModelError`, naming both models, unless ``draft`` has the
    served model's vocabulary: the same size and the same token string at every id (a
    draft's token ids must mean the served model's), and an embedding row for each id."""
    names = (
        f"draft model {draft.name} ({draft.source}) and "
        f"served model {served.name} ({served.source})"
    )
    mine, theirs = served.tokenizer, draft.tokenizer
    if mine.vocab_size != theirs.vocab_size:
        raise UnsupportedModelError(
            f"{names} have different vocabularies: {theirs.vocab_size} and "
            f"{mine.vocab_size} tokens; a draft model needs the served model's tokenizer"
        )
    a = mine.hf_tokenizer.get_vocab(with_added_tokens=True)
    b = theirs.hf_tokenizer.get_vocab(with_added_tokens=True)
    if a != b:
        by_id = {i: t for t, i in b.items()}
        i, token = min(((i, t) for t, i in a.items() if by_id.get(i) != t), default=(-1, ""))
        where = f": token {i} is {by_id.get(i)!r} in the draft model and {token!r}" if token else ""
        raise UnsupportedModelError(
            f"{names} have different vocabularies{where}; a draft model needs the served "
            "model's tokenizer"
        )
    if draft.config.vocab_size < mine.vocab_size:
        raise UnsupportedModelError(
            f"{names}: the draft model's embedding has {draft.config.vocab_size} rows for "
            f"{mine.vocab_size} tokens"
        )
