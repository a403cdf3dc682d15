"""A scripted :class:`~furnace_trio.core.plan.StepRunner` for engine and HTTP tests.

It emits chosen tokens, keyed by the prompt, and checks the plans it gets: it simulates the
paged KV pool (``kv[block][slot]`` holds the token written there) and, before sampling,
reads a sequence's whole context back through its block table and compares it with the
sample's ``prompt_token_ids + output_token_ids``. So a block freed too early, a missed
copy-on-write or a wrong ``start_pos`` fails the step (:class:`KVMismatch`), which fails
the request, which the test sees.

The toy vocabulary: ids ``0..255`` are single bytes; :data:`PIECES` maps a few ids above
255 to multi-byte pieces (parts of UTF-8 characters), so splits are testable; :data:`EOS`
decodes to nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from furnace_trio.core.plan import SampledToken, SampleSpec, StepPlan, TokenLogprob

EOS = 300
#: id -> bytes for ids >= 256: "é" whole, "€" whole, then "😀" split in two pieces.
PIECES: dict[int, bytes] = {
    256: "é".encode(),
    257: "€".encode(),
    258: "😀".encode()[:2],
    259: "😀".encode()[2:],
    EOS: b"",
}
FILLER = ord("x")


def token_bytes(token_id: int) -> bytes:
    if 0 <= token_id < 256:
        return bytes((token_id,))
    return PIECES.get(token_id, b"")


def decode(token_ids: Sequence[int]) -> str:
    return b"".join(token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def encode(text: str) -> tuple[int, ...]:
    """Bytes as token ids (no multi-byte pieces): for prompts and scripts."""
    return tuple(text.encode())


class KVMismatch(RuntimeError):
    """A plan's block tables do not hold what the sequence has computed."""


Script = Mapping[tuple[int, ...], Sequence[int]] | Callable[[tuple[int, ...], int], Sequence[int]]


class ScriptedRunner:
    """Implements ``StepRunner``: token ``k`` of sample ``i`` of a prompt is ``script[k]``.

    ``script`` maps a prompt to its output tokens (every sample alike), or is a function
    ``(prompt, sample_index) -> tokens``; past the script's end (or for an unknown prompt)
    the runner emits :data:`FILLER`. Every plan is recorded in :attr:`plans`. ``fail_on``
    holds step numbers (0-based) that raise; ``fail_when(plan)`` may decide too. A step
    raises after writing its chunks to the cache, as a failure in sampling would.
    ``sleep`` makes each step call ``time.sleep(sleep)`` (0 yields the GIL, like a kernel).
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        max_context: int = 1024,
        fail_on: Collection[int] = (),
        fail_when: Callable[[StepPlan], bool] | None = None,
        sleep: float | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self._script = script if script is not None else {}
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._max_context = max_context
        self.fail_on = set(fail_on)
        self.fail_when = fail_when
        self.sleep = sleep
        self.gate = gate  # when set, each step waits for it (a test opens it)
        self.plans: list[StepPlan] = []
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self._sample_index: dict[int, int] = {}
        self.released: set[int] = set()
        #: Prompt scores by prompt sequence (see prompt_score), as the runner keeps them.
        self.scores: dict[int, list[SampledToken]] = {}
        #: A draft model's stand-in (``FURNACE_SPECULATIVE=draft``): given a sequence's
        #: tokens and ``k``, its ``k`` proposals, which replace a drafted chunk's drafts.
        self.drafter: Callable[[tuple[int, ...], int], Sequence[int]] | None = None

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_context(self) -> int:
        return self._max_context

    def tokens_for(self, prompt: tuple[int, ...], index: int) -> Sequence[int]:
        if callable(self._script):
            return self._script(prompt, index)
        return self._script.get(prompt, ())

    def step(self, plan: StepPlan) -> list[SampledToken]:
        number = len(self.plans)
        self.plans.append(plan)
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if self.sleep is not None:
            time.sleep(self.sleep)
        bs = self._block_size
        if self.drafter is not None:
            plan = plan.with_drafts(
                {
                    c.seq_id: self.drafter(
                        c.samples[0].prompt_token_ids + c.samples[0].output_token_ids,
                        c.num_drafts,
                    )
                    for c in plan.chunks
                    if c.num_drafts
                }
            )
        for src, dst in plan.block_copies:
            self.kv[dst] = list(self.kv[src])
        for chunk in plan.chunks:
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                self.kv[chunk.block_table[pos // bs]][pos % bs] = token
        # A failure after the cache was written, as one in sampling would be.
        if number in self.fail_on or (self.fail_when is not None and self.fail_when(plan)):
            raise RuntimeError(f"scripted failure at step {number}")
        out: list[SampledToken] = []
        for chunk in plan.chunks:
            scores = self.scores.setdefault(chunk.seq_id, [])
            del scores[chunk.start_pos :]  # a chunk run again (after a failed step)
            scores.extend(prompt_score(chunk.seq_id, t, chunk.score_top) for t in chunk.score_ids)
            end = chunk.start_pos + len(chunk.token_ids) - chunk.num_drafts
            context = [chunk_token(self.kv, chunk.block_table, p, bs) for p in range(end)]
            for i, spec in enumerate(chunk.samples):
                expected = [*spec.prompt_token_ids, *spec.output_token_ids]
                if context != expected:
                    raise KVMismatch(f"seq {spec.seq_id}: cache {context} != {expected}")
                index = self._sample_index.setdefault(spec.seq_id, i)
                if chunk.num_drafts:
                    verified = self._verify(spec, index, chunk.draft_token_ids)
                    if self.drafter is not None:
                        proposed = chunk.draft_token_ids
                        verified[0] = dataclasses.replace(verified[0], proposed=proposed)
                    out.extend(verified)
                    continue
                token = self._sample(spec, index)
                if spec.params.prompt_logprobs is not None and not spec.output_token_ids:
                    scores = tuple(self.scores.get(chunk.seq_id, ()))
                    token = dataclasses.replace(token, prompt_logprobs=scores)
                out.append(token)
        self.released.update(plan.released)
        return out

    def _verify(self, spec: SampleSpec, index: int, drafts: tuple[int, ...]) -> list[SampledToken]:
        """A drafted chunk's tokens: the script's token at each position while it equals
        the draft there, then the first that differs (or the one after the last draft)."""
        out: list[SampledToken] = []
        for i in range(len(drafts) + 1):
            position = dataclasses.replace(
                spec, output_token_ids=spec.output_token_ids + drafts[:i]
            )
            token = self._sample(position, index)
            out.append(token)
            if i == len(drafts) or token.token_id != drafts[i]:
                break
        return out

    def _sample(self, spec: SampleSpec, index: int) -> SampledToken:
        seq_id, params = spec.seq_id, spec.params
        tokens = self.tokens_for(spec.prompt_token_ids, index)
        k = len(spec.output_token_ids)
        token = tokens[k] if k < len(tokens) else FILLER
        if params.logprobs is None:
            return SampledToken(seq_id, token)
        top = tuple(TokenLogprob(token + j, -0.5 - j) for j in range(params.logprobs))
        return SampledToken(seq_id, token, -0.5, top)


class _UnreadableToken:
    """A sampled token whose ``seq_id`` raises: reading the step's results fails inside the
    engine task, as a bug in the engine would (a raising step fails only its requests)."""

    @property
    def seq_id(self) -> int:
        raise RuntimeError("scheduler bug")


class EngineKillingRunner(ScriptedRunner):
    """Steps return a token the engine cannot read, so the first step kills the engine task
    (what a bug in the engine does): the public way for a test to reach a dead engine."""

    def step(self, plan: StepPlan) -> list[SampledToken]:
        super().step(plan)
        return [_UnreadableToken()]  # type: ignore[list-item]


def prompt_score(seq_id: int, token_id: int, top: int) -> SampledToken:
    """The scripted score of a prompt token: its logprob ``-token_id / 100``, and ``top``
    alternatives (the token itself first, then the next ids, each 1 less likely)."""
    logprob = -token_id / 100
    alternatives = tuple(TokenLogprob(token_id + j, logprob - j) for j in range(top))
    return SampledToken(seq_id, token_id, logprob, alternatives)


def chunk_token(kv: list[list[int | None]], table: Sequence[int], pos: int, bs: int) -> int | None:
    return kv[table[pos // bs]][pos % bs]
