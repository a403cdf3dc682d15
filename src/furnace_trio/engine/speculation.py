"""Speculative decoding, the engine's side: proposing drafts and keeping their books.

On a CPU one stream is bound by reading the weights once per token. A decoding sequence
that proposes ``k`` draft tokens runs them with its last token as one chunk of ``k + 1``
tokens, so one read of the weights checks all of them; the runner verifies the drafts
(:attr:`~furnace_trio.core.plan.ChunkPlan.num_drafts`) and returns the accepted ones and
one more token of its own, so a step yields between 1 and ``k + 1`` tokens::

    token_ids   ... a b c [d]             d: the last token, not yet in the KV cache
    chunk            [d  x  y  z]         x y z: drafts, run with d in one step
    drawn             x' y' z' w'         the model's token at each position
    accepted          x'==x, y'!=y  ->  output x y', KV kept for d x, y z dropped

Drafts come from **prompt lookup** (``ngram``): the last ``n`` tokens of the sequence
(``n`` from :attr:`SpeculationConfig.ngram_max` down to ``ngram_min``) are looked up in
everything before them (prompt and output), and the tokens that followed their latest
occurrence are proposed. An index of every n-gram's latest position grows by the new
tokens only, so a lookup costs a few dict probes, not a scan of the context.

With a **draft model** (``draft``), the engine only decides which sequences draft and how
many positions (it reserves their KV): their drafts are placeholders (the last token
repeated), and the runner's draft model, a smaller model with the same vocabulary,
replaces them with its greedy proposals before the verifying forward pass
(``runtime/draft.py``); the runner returns what it proposed with the verified tokens
(:attr:`~furnace_trio.core.plan.SampledToken.proposed`). A greedy proposal is a
deterministic one (its distribution ``q`` is one-hot), so the same rejection rule keeps
sampled output distributed as without speculation.

Per sequence, the draft length adapts: it starts short (a wrong guess costs a row of
compute per draft), doubles while every draft is accepted and shrinks to what was
accepted otherwise; a step that accepts nothing makes the sequence
sit out a number of steps that doubles with each miss in a row (text that repeats nothing
stops paying for drafts). Under load, with more than :attr:`SpeculationConfig.max_batch`
sequences decoding, no sequence drafts: the step is then compute-bound and draft positions
would slow everyone; with fewer, a step holds at most ``max_drafts`` drafts in all.

Which sequences speculate: greedy ones and unseeded sampled ones, grammar-constrained
or not. A seeded sampled request draws one noise row per token from its own generator,
so it stays reproducible only if it never speculates (whether it drafts would depend on
the load). A grammar-constrained one's drafts are checked against its grammar in the
runner's step (:func:`~furnace_trio.runtime.verification.draft_specs`): a draft the
grammar refuses is rejected there, and the constraint goes back over the drafts the
output does not keep.

KV of rejected drafts: their positions lie past the sequence's computed tokens, in blocks
that are never keyed (only full blocks of computed tokens reach the prefix cache) and that
the scheduler gives back to the sequence's reservation
(:meth:`~furnace_trio.engine.kv_cache_manager.KVCacheManager.truncate`); a partial block's
stale slots are written over by the next tokens before the block is ever full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampledToken, StepPlan
from furnace_trio.engine.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from furnace_trio.engine.sequence import Seq

__all__ = ["METHODS", "DraftState", "SpeculationConfig", "Speculator", "answers", "until_end"]

#: How drafts are made: none, prompt lookup, or the runner's draft model.
METHODS = ("off", "ngram", "draft")

#: The longest run of steps a sequence whose drafts keep missing sits out.
MAX_SIT_OUT = 32


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How the engine speculates; ``method`` ``off`` turns it off."""

    method: str = "off"
    max_drafts: int = 16  # drafts per sequence and step, at most
    first_drafts: int = 4  # a sequence's first draft length (it doubles while all hold)
    max_batch: int = 4  # no drafts while more sequences than this decode
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}")
        if self.max_drafts < 1:
            raise ValueError("max_drafts must be at least 1")
        if self.first_drafts < 1:
            raise ValueError("first_drafts must be at least 1")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(slots=True, eq=False)
class DraftState:
    """One sequence's prompt-lookup index and draft policy (see the module docstring)."""

    length: int  # drafts to propose next
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in ``index``
    sit_out: int = 0  # steps left without drafts
    misses: int = 0  # steps in a row that accepted nothing
    drafted: int = 0
    accepted: int = 0


def speculates(params: SamplingParams) -> bool:
    """Whether a sample with ``params`` may take drafts (see the module docstring)."""
    return params.greedy or params.seed is None


class Speculator:
    """Proposes each step's drafts and adapts each sequence's draft length."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config

    def propose_all(self, seqs: Sequence[Seq], budget: int) -> dict[int, tuple[int, ...]]:
        """Drafts by seq id for this step's decoding ``seqs``, ``budget`` tokens in all and
        never more than ``max_drafts``: each draft is a row of compute, so a step holds as
        many as one sequence may draft, however many sequences share it."""
        if len(seqs) > self.config.max_batch:
            return {}
        budget = min(budget, self.config.max_drafts)
        out: dict[int, tuple[int, ...]] = {}
        for seq in seqs:
            if budget <= 0:
                break
            if not speculates(seq.params):
                continue
            limit = min(budget, seq.params.max_tokens - seq.num_output_tokens - 1)
            drafts = self.propose(seq, limit)
            if drafts:
                out[seq.seq_id] = drafts
                budget -= len(drafts)
        return out

    def propose(self, seq: Seq, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` drafts for ``seq`` (none while it sits out)."""
        state = seq.draft
        if state is None:
            state = seq.draft = DraftState(min(self.config.first_drafts, self.config.max_drafts))
        if state.sit_out:
            state.sit_out -= 1
            return ()
        limit = min(limit, state.length)
        if limit <= 0:
            return ()
        tokens = seq.token_ids
        if self.config.method == "draft":  # placeholders: the runner's draft model fills them
            return (tokens[-1],) * limit
        end = len(tokens)
        index = state.index
        low, high = self.config.ngram_min, self.config.ngram_max
        # index the n-grams that end at each new position j < end (followed by tokens[j])
        for j in range(max(state.indexed, low), end):
            for n in range(low, min(high, j) + 1):
                index[tuple(tokens[j - n : j])] = j
        state.indexed = max(state.indexed, end)
        for n in range(min(high, end - 1), low - 1, -1):
            at = index.get(tuple(tokens[end - n :]))
            if at is not None:
                return tuple(tokens[at : at + limit])
        return ()

    def settle(
        self,
        seq: Seq,
        chunk: ChunkPlan,
        tokens: Sequence[SampledToken],
        kv: KVCacheManager,
        ends: frozenset[int],
    ) -> tuple[Sequence[SampledToken], int]:
        """After a drafted ``chunk`` of ``seq`` ran: the verified ``tokens`` up to the first
        that ends the sample (what the caller appends), and how many drafts that accepted.

        The KV of the last token and of the kept drafts stays computed (and full blocks of
        it are keyed for the prefix cache); the blocks past it go back to the sequence's
        reservation, before anything could pin or share them."""
        kept = until_end(tokens, seq.params, ends, seq.num_output_tokens)
        computed = chunk.start_pos + len(chunk.token_ids) - chunk.num_drafts - 1 + len(kept)
        seq.num_computed_tokens = computed
        kv.truncate(seq.kv, computed)
        kv.cache_blocks(seq.kv, [*seq.token_ids, *(t.token_id for t in kept[:-1])], computed)
        accepted = min(len(tokens) - 1, len(kept))
        self.record(seq, chunk.num_drafts, accepted)
        return kept, accepted

    def record(self, seq: Seq, drafted: int, accepted: int) -> None:
        """``accepted`` of the ``drafted`` drafts of ``seq`` held."""
        state = seq.draft
        if state is None:
            return
        state.drafted += drafted
        state.accepted += accepted
        most = self.config.max_drafts
        if accepted == drafted:
            state.length = min(most, 2 * state.length)
            state.misses = 0
        elif accepted:
            state.length = max(1, accepted + 1)
            state.misses = 0
        else:
            state.length = max(1, state.length // 2)
            state.misses += 1
            state.sit_out = min(MAX_SIT_OUT, 1 << (state.misses - 1))


def answers(plan: StepPlan, sampled: Sequence[SampledToken]) -> dict[int, list[SampledToken]]:
    """The runner's tokens by seq id, checked against ``plan``: one per sample, or for a
    drafted chunk between 1 and ``num_drafts + 1``, all but the last its drafts (the
    plan's, or those the runner proposed itself, on the first token). Raises
    ``ValueError`` when they do not answer the plan."""
    by_seq: dict[int, list[SampledToken]] = {}
    for token in sampled:
        by_seq.setdefault(token.seq_id, []).append(token)
    expected = 0
    for chunk in plan.chunks:
        for spec in chunk.samples:
            expected += 1
            tokens = by_seq.get(spec.seq_id)
            most = chunk.num_drafts + 1
            if tokens is None or not 1 <= len(tokens) <= most:
                raise ValueError(f"the runner returned no answer fitting sample {spec.seq_id}")
            drafts = tokens[0].proposed or chunk.draft_token_ids
            if len(drafts) != chunk.num_drafts:
                raise ValueError(f"the runner proposed {len(drafts)} of {chunk.num_drafts} drafts")
            if any(t.token_id != d for t, d in zip(tokens[:-1], drafts, strict=False)):
                raise ValueError(
                    f"the runner accepted tokens that sample {spec.seq_id} did not draft"
                )
    if len(by_seq) != expected:
        raise ValueError(f"the runner returned {len(sampled)} tokens for {expected} samples")
    return by_seq


def until_end(
    tokens: Sequence[SampledToken], params: SamplingParams, ends: frozenset[int], num_output: int
) -> Sequence[SampledToken]:
    """``tokens`` up to and including the first that ends the sample (an end token, or
    the one that reaches ``max_tokens``): what plain decoding would have produced."""
    for i, token in enumerate(tokens):
        tid = token.token_id
        if (not params.ignore_eos and tid in ends) or tid in params.stop_token_ids:
            return tokens[: i + 1]
        if num_output + i + 1 >= params.max_tokens:
            return tokens[: i + 1]
    return tokens
