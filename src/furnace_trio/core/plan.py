"""The immutable step plan the engine hands the model runner, and what comes back.

The engine (Trio thread) builds a :class:`StepPlan`; the runner (a worker thread) executes
it and returns one :class:`SampledToken` per requested sample. Nothing here imports torch,
so the scheduler and its tests stay plain Python.

Block tables index a paged KV pool of ``num_blocks`` blocks of ``block_size`` token slots.
Token position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``::

    block_table = (7, 2, 9)       block_size = 4
    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block        --7--- | --2---- | -9-
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from furnace_trio.core.params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """Sample one next token for ``seq_id`` from the logits after a chunk's last token.

    ``prompt_token_ids`` and ``output_token_ids`` feed the presence, frequency and
    repetition penalties. The runner keeps one generator per ``seq_id`` (seeded from
    ``params.seed`` when given) until the seq id is listed in :attr:`StepPlan.released`.
    """

    seq_id: int
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """New tokens of one sequence to run through the model in this step.

    ``start_pos`` tokens of the sequence are already in the KV cache; ``token_ids`` occupy
    positions ``start_pos .. start_pos + len(token_ids) - 1``. ``block_table`` covers at
    least every one of those positions. ``samples`` is empty for a prefill chunk that is
    not the prompt's last; ``n > 1`` requests sample several children (each with its own
    seq id) from one chunk's logits.

    ``score_ids`` (a request with ``prompt_logprobs``) are the prompt tokens that this
    chunk's positions predict, in order from its first position: the tokens after each of
    its tokens, up to the prompt's end. The runner gives their logprobs (and the
    ``score_top`` most likely alternatives) with the prompt's sampled tokens, in
    :attr:`SampledToken.prompt_logprobs`.

    ``num_drafts`` (speculative decoding; a decode chunk with exactly one sample): the last
    ``num_drafts`` of ``token_ids`` are proposed tokens, not yet sampled. The runner
    verifies them from the logits at the chunk's last ``num_drafts + 1`` positions and
    returns the sample's tokens in order: the drafts it accepted (a prefix of them, each
    the token it drew at that position) and then one token it drew itself, so between 1
    and ``num_drafts + 1`` tokens. The sample's ``output_token_ids`` do not hold the drafts.
    A runner with a draft model (``FURNACE_SPECULATIVE=draft:<path>``) proposes the drafts
    itself: the plan's are placeholders that it replaces before running the chunk (see
    :meth:`StepPlan.with_drafts`), and the first token it returns for the chunk carries
    the drafts it verified (:attr:`SampledToken.proposed`).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    samples: tuple[SampleSpec, ...] = ()
    score_ids: tuple[int, ...] = ()
    score_top: int = 0
    num_drafts: int = 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        """The proposed tokens at the chunk's end (``()`` without drafts)."""
        return self.token_ids[len(self.token_ids) - self.num_drafts :] if self.num_drafts else ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One model step.

    Order of execution: ``block_copies`` (src, dst) are copied first (copy-on-write of a
    shared partial block), then every chunk's tokens are written to the cache and attended
    in one batched forward pass, then the samples are drawn. ``released`` seq ids drop
    their per-sequence sampler state (a seq id released again, or never seen, is a no-op).
    """

    chunks: tuple[ChunkPlan, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    released: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    def with_drafts(self, proposals: Mapping[int, Sequence[int]]) -> StepPlan:
        """This plan with the drafts of the chunks named in ``proposals`` (by seq id)
        replaced by the proposed tokens, as many as the chunk has drafts."""
        chunks = []
        for chunk in self.chunks:
            drafts = proposals.get(chunk.seq_id)
            if drafts is not None and chunk.num_drafts:
                if len(drafts) != chunk.num_drafts:
                    raise ValueError(
                        f"{len(drafts)} drafts for the {chunk.num_drafts} of seq {chunk.seq_id}"
                    )
                kept = chunk.token_ids[: len(chunk.token_ids) - chunk.num_drafts]
                chunk = dataclasses.replace(chunk, token_ids=kept + tuple(drafts))
            chunks.append(chunk)
        return dataclasses.replace(self, chunks=tuple(chunks))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A sampled token; ``logprob``/``top_logprobs`` are filled when the params ask."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()
    #: With ``prompt_logprobs``, on the first token of each sample: every prompt token
    #: after the first, scored (``seq_id`` is the prompt's sequence).
    prompt_logprobs: tuple[SampledToken, ...] | None = None
    #: On the first token of a drafted chunk: the drafts the runner verified (set by every
    #: runner that computes them itself; ``()`` means the plan's).
    proposed: tuple[int, ...] = ()


class StepRunner(Protocol):
    """What the engine needs of a model: the real runner, or a scripted one in tests.

    ``step`` returns one :class:`SampledToken` per sample of the plan, except for a chunk
    with drafts (:attr:`ChunkPlan.num_drafts`), whose sample gets its verified tokens in
    order. ``step`` blocks (it runs on a worker thread) and may raise. The engine then runs the
    plan's chunks again in smaller plans (without its block copies and releases, which
    run first in a plan of no chunks) until it knows which requests make it raise, and
    fails only those. So a step must be safe to run again with a subset of its chunks:
    writing a chunk's keys and values again is, and what the runner keeps per sequence
    (prompt scores, a grammar's matcher) must not count a chunk twice.
    """

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def step(self, plan: StepPlan) -> list[SampledToken]: ...
