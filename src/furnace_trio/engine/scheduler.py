"""Admission and step planning: which tokens of which sequences run in the next model step.

Plain Python (no Trio, no torch), in the style of vLLM v1: a sequence has ``token_ids``
(prompt, then output) and ``num_computed_tokens`` (how many of them are in the KV cache).
There is no prefill or decode phase: a step runs ``token_ids[num_computed_tokens:]`` of a
sequence, or a chunk of it, and samples when the chunk reaches the end of the tokens.

Each :meth:`Scheduler.schedule` builds one :class:`~furnace_trio.core.plan.StepPlan` within
``max_step_tokens``, in this order:

1. every running sequence that is decoding gets its one next token (running streams never
   wait behind a prompt for more than one step),
2. sequences still prefilling get their next prompt chunk, oldest first (chunked prefill),
3. waiting requests are admitted first come first served while there is budget, a free
   sequence slot (``max_running``) and enough unreserved KV blocks; the queue head is never
   overtaken, so a large request is not starved by small ones.

Memory: **reservation, no preemption.** Admission reserves the worst case of a request's
KV blocks (prompt + ``max_tokens`` for each of its ``n`` samples, full prompt blocks shared)
and blocks are then allocated lazily from that reservation as positions are written. So a
sequence, once admitted, can always finish: no preemption, no recomputation, no swapping,
and a request's latency never jumps because another one arrived. The cost is admitting
fewer requests than lazy allocation would when most stop early; with a prefix cache (whose
evictable blocks count as free) and the usual short ``max_tokens`` that is the right trade
for a small server. ``kv_blocks_used`` counts blocks really written, not reservations.

``n > 1``: a *parent* sequence runs the prompt once; its last chunk samples ``n`` children
(their own seq ids, ``seed + index`` when seeded so that they differ). Each child that goes
on forks the parent's blocks (full blocks shared, the partial last one copied through
``StepPlan.block_copies``), then the parent lets go of its blocks.

Prefix cache: at admission the prompt's full blocks are looked up by chain key
(:mod:`~furnace_trio.engine.block_pool`); the longest cached run becomes the start of the block
table and of ``num_computed_tokens``, so only the rest is computed. The match stops before
the block holding the prompt's last token, which is always computed (its logits are
sampled) and so never written into a shared block. The reservation shrinks by the blocks
reused, and unreferenced cached blocks that the match revives are subtracted from the free
count, so admission stays exact. After each step, blocks that became full get their keys.

Sessions: a request added with ``keep_kv`` pins, when it finishes naturally, the cached
blocks of everything it computed (:class:`KeptKV`, taken with :meth:`Scheduler.pop_kept`);
an aborted or failed request keeps nothing. When the queue head does not fit, the
``reclaim`` hook (the engine's session store) may drop pins and admission tries again.

Aborts (:meth:`Scheduler.abort`) are synchronous and free blocks at once. That is safe
while a step is in flight: blocks are only handed out again by the next ``schedule()``,
which runs after that step has returned; :meth:`Scheduler.update` ignores tokens of
sequences that are gone.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampledToken, SampleSpec, StepPlan
from furnace_trio.engine.block_pool import BlockKey, BlockPool, block_key, prefix_keys

logger = logging.getLogger(__name__)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class StepMismatch(ValueError):
    """The runner's tokens do not answer the plan's samples (a runner bug, not ours)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(slots=True, eq=False)
class Seq:
    """One sequence: a request's single sample, or the prompt-only parent of ``n > 1``.

    Invariants: ``num_computed_tokens <= len(token_ids)``; ``block_table`` covers the first
    ``num_computed_tokens`` positions; ``reserved_blocks`` more blocks may still be
    allocated for it without asking the pool for room.
    """

    seq_id: int
    group: Group
    index: int | None  # sample index; None for the parent of n > 1
    params: SamplingParams
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    reserved_blocks: int = 0
    status: SeqStatus = SeqStatus.WAITING
    block_keys: list[BlockKey] = field(default_factory=list)  # of block_table's first blocks

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


@dataclass(frozen=True, slots=True)
class KeptKV:
    """What a finished ``keep_kv`` request leaves pinned: one reference to each block.

    ``token_ids`` are the tokens whose KV ``blocks`` hold (full blocks only);
    ``output_token_ids`` is what the request generated (EOS excluded).
    """

    token_ids: tuple[int, ...]
    blocks: tuple[int, ...]
    output_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A plan plus what the engine needs to know about it."""

    plan: StepPlan
    admitted: tuple[str, ...]  # requests whose prefill starts in this step
    cached_tokens: tuple[int, ...]  # per admitted request: prompt tokens from the cache
    request_ids: tuple[str, ...]  # every request with a chunk in the plan
    num_prefill_tokens: int
    num_decode_tokens: int


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """A sampled token of sample ``index`` of a request, and whether that sample finished.

    ``token`` is ``None`` when the sampled token ends the sample without being part of the
    output (an EOS or a ``stop_token_ids`` token).
    """

    request_id: str
    index: int
    token: SampledToken | None
    finish: FinishReason | None
    #: The prompt's scores (``prompt_logprobs``), with each sample's first token, even
    #: one that is not output.
    prompt_logprobs: tuple[SampledToken, ...] | None = None


class Scheduler:
    """Waiting queue, running requests, and the KV blocks they hold."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_running: int,
        max_step_tokens: int,
        max_context: int,
        eos_token_ids: Iterable[int],
    ) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        if max_step_tokens < max_running:
            raise ValueError("max_step_tokens must be at least max_running (one token each)")
        if max_context < 2:
            raise ValueError("max_context must be at least 2")
        self.pool = pool
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Group] = deque()
        self.running: dict[str, Group] = {}  # insertion order == admission order
        self._waiting_ids: dict[str, Group] = {}
        self._seqs: dict[int, Seq] = {}  # running sequences by seq id
        self._next_seq_id = 0
        self._reserved = 0  # blocks reserved by running sequences, not yet allocated
        self._num_slots = 0  # live samples of running requests
        self._released: list[int] = []
        self._copies: list[tuple[int, int, int]] = []  # (src, dst, child seq id)
        self._kept: dict[str, KeptKV] = {}
        #: Called with the number of blocks missing when the queue head does not fit; may
        #: free pinned blocks (sessions). Admission then tries once more.
        self.reclaim: Callable[[int], None] | None = None
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- sizes ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding a running slot (``n`` per request)."""
        return self._num_slots

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Worst-case KV blocks of a request: what admission reserves.

        The last sampled token is never fed back, so a sample writes at most
        ``prompt + max_tokens - 1`` positions.
        """
        bs = self.pool.block_size
        last = num_prompt_tokens + params.max_tokens - 1
        if params.n == 1:
            return self.pool.blocks_for(last)
        per_child = self.pool.blocks_for(last) - num_prompt_tokens // bs
        return self.pool.blocks_for(num_prompt_tokens) + params.n * per_child

    def contains(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self._waiting_ids

    # -- requests ---------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        keep_kv: bool = False,
    ) -> None:
        """Queue a request; the caller has checked it fits (see :meth:`blocks_needed`).

        ``keep_kv`` (``n == 1`` only): pin its KV when it finishes, see :meth:`pop_kept`.
        """
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.contains(request_id):
            raise ValueError(f"request {request_id!r} exists already")
        if keep_kv and params.n != 1:
            raise ValueError("keep_kv needs n == 1")
        prompt = tuple(prompt)
        group = Group(
            request_id=request_id,
            prompt=prompt,
            params=params,
            blocks_needed=self.blocks_needed(len(prompt), params),
            prompt_keys=tuple(prefix_keys(prompt, self.pool.block_size)),
            keep_kv=keep_kv,
        )
        if params.n == 1:
            seq = self._new_seq(group, 0, params)
            group.prefill = seq
            group.samples = [seq]
        else:
            group.prefill = self._new_seq(group, None, params)
            for i in range(params.n):
                child_params = params
                if params.seed is not None:
                    child_params = dataclasses.replace(params, seed=params.seed + i)
                group.samples.append(self._new_seq(group, i, child_params))
        group.num_live = params.n
        self.waiting.append(group)
        self._waiting_ids[request_id] = group

    def abort(self, request_id: str, *, keep: bool = False) -> bool:
        """Drop a request in any state, freeing its blocks now. Whether it was known.

        ``keep``: the request ended normally (a stop string), so a ``keep_kv`` request
        still pins its KV; a plain abort (disconnect, failure) pins nothing.
        """
        group = self._waiting_ids.pop(request_id, None)
        if group is not None:
            self.waiting.remove(group)
            group.status = SeqStatus.FINISHED
            return True
        group = self.running.get(request_id)
        if group is None:
            return False
        if group.prefill is not None and group.prefill.index is None:
            self._drop_seq(group.prefill)  # the parent of n > 1
            group.prefill = None
        for seq in group.samples:
            if seq.status is not SeqStatus.FINISHED:
                self._finish_seq(seq, keep=keep)
        return True

    def abort_sample(self, request_id: str, index: int) -> bool:
        """End one sample (a stop string matched); the request ends with its last sample."""
        group = self.running.get(request_id)
        if group is None or not 0 <= index < len(group.samples):
            return False
        seq = group.samples[index]
        if seq.status is SeqStatus.FINISHED:
            return False
        if group.params.n == 1:
            return self.abort(request_id, keep=True)
        self._finish_seq(seq)
        return True

    def pop_kept(self, request_id: str) -> KeptKV | None:
        """The pins a finished ``keep_kv`` request left; the caller owns (and frees) them."""
        return self._kept.pop(request_id, None)

    # -- planning ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """The next step, or ``None`` when there is nothing to run."""
        budget = self.max_step_tokens
        chunks: list[ChunkPlan] = []
        request_ids: list[str] = []
        num_decode = 0
        # 1. one token for every decoding sequence
        for group in self.running.values():
            if group.prefill is not None and group.prefill.num_computed_tokens < len(group.prompt):
                continue
            request_ids.append(group.request_id)
            for seq in group.samples:
                if seq.status is SeqStatus.RUNNING:
                    chunks.append(self._chunk(seq, len(seq.token_ids) - seq.num_computed_tokens))
                    num_decode += 1
        budget -= num_decode
        # 2. prompt chunks of running requests, oldest first
        for group in self.running.values():
            if budget <= 0:
                break
            prefill = group.prefill
            if prefill is None or prefill.num_computed_tokens >= len(group.prompt):
                continue
            take = min(len(group.prompt) - prefill.num_computed_tokens, budget)
            chunks.append(self._chunk(prefill, take))
            request_ids.append(group.request_id)
            budget -= take
        # 3. admission, first come first served
        admitted: list[str] = []
        cached: list[int] = []
        while budget > 0 and self.waiting:
            group = self.waiting[0]
            if self._num_slots + group.params.n > self.max_running:
                break
            hit = self._match(group)
            missing = self._shortage(group, hit)
            if missing > 0 and self.reclaim is not None:
                self.reclaim(missing)
                hit = self._match(group)
                missing = self._shortage(group, hit)
            if missing > 0:
                break
            self.waiting.popleft()
            del self._waiting_ids[group.request_id]
            self._admit(group, hit)
            admitted.append(group.request_id)
            cached.append(group.cached_tokens)
            request_ids.append(group.request_id)
            assert group.prefill is not None
            take = min(len(group.prompt) - group.prefill.num_computed_tokens, budget)
            chunks.append(self._chunk(group.prefill, take))
            budget -= take
        if not chunks:
            return None
        live_copies = [(s, d) for s, d, child in self._copies if child in self._seqs]
        self._copies.clear()
        released, self._released = tuple(self._released), []
        plan = StepPlan(chunks=tuple(chunks), block_copies=tuple(live_copies), released=released)
        return ScheduledStep(
            plan=plan,
            admitted=tuple(admitted),
            cached_tokens=tuple(cached),
            request_ids=tuple(request_ids),
            num_prefill_tokens=self.max_step_tokens - budget - num_decode,
            num_decode_tokens=num_decode,
        )

    # -- results ----------------------------------------------------------------------------

    def update(self, step: ScheduledStep, sampled: Sequence[SampledToken]) -> list[SampleOutput]:
        """Apply a step's results: advance the counters, append tokens, detect the ends.

        Raises :class:`StepMismatch` (changing nothing) when ``sampled`` does not answer the plan's
        samples exactly; the caller then fails the plan's requests like a raising step.
        """
        by_seq = {token.seq_id: token for token in sampled}
        expected = [spec.seq_id for chunk in step.plan.chunks for spec in chunk.samples]
        if len(by_seq) != len(sampled) or by_seq.keys() != set(expected):
            raise StepMismatch(
                f"the runner returned {len(sampled)} tokens for {len(expected)} samples"
            )
        outputs: list[SampleOutput] = []
        for chunk in step.plan.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self._register(seq)
            if not chunk.samples:
                continue
            group = seq.group
            if seq.index is not None:
                outputs.append(self._append(seq, by_seq[seq.seq_id]))
                continue
            # the parent of n > 1: each child that goes on forks the prompt's blocks
            for spec in chunk.samples:
                child = self._seqs.get(spec.seq_id)
                if child is None:
                    continue
                output = self._append(child, by_seq[child.seq_id])
                outputs.append(output)
                if output.finish is None:
                    self._fork(seq, child)
            self._drop_seq(seq)
            group.prefill = None
        return outputs

    def fail(self, step: ScheduledStep) -> list[str]:
        """Drop every request of a failed step; their ids. The step's releases still count."""
        self._released.extend(step.plan.released)
        failed = [rid for rid in dict.fromkeys(step.request_ids) if self.abort(rid)]
        return failed

    def abort_all(self) -> list[str]:
        """Drop every request (the engine is going away); their ids."""
        ids = [g.request_id for g in self.waiting] + list(self.running)
        for rid in ids:
            self.abort(rid)
        return ids

    # -- internals --------------------------------------------------------------------------

    def _new_seq(self, group: Group, index: int | None, params: SamplingParams) -> Seq:
        seq = Seq(
            seq_id=self._next_seq_id,
            group=group,
            index=index,
            params=params,
            token_ids=list(group.prompt),
        )
        self._next_seq_id += 1
        return seq

    def _match(self, group: Group) -> list[int]:
        """Cached blocks of the prompt's longest cached prefix, short of its last token
        (none where the prompt is scored: every position must be computed)."""
        if group.params.prompt_logprobs is not None:
            return []
        usable = (len(group.prompt) - 1) // self.pool.block_size
        return self.pool.match(group.prompt_keys[:usable])

    def _shortage(self, group: Group, hit: list[int]) -> int:
        """Blocks missing to admit ``group`` reusing ``hit`` (<= 0: it fits).

        Reused blocks need no reservation, but reviving unreferenced ones takes them out of
        the free count that the other reservations rely on.
        """
        available = self.pool.num_free - self.pool.num_evictable(hit) - self._reserved
        return group.blocks_needed - len(hit) - available

    def _admit(self, group: Group, hit: list[int]) -> None:
        bs = self.pool.block_size
        prompt_len = len(group.prompt)
        last = prompt_len + group.params.max_tokens - 1
        group.status = SeqStatus.RUNNING
        self.running[group.request_id] = group
        self._num_slots += group.params.n
        assert group.prefill is not None
        prefill = group.prefill
        self.pool.acquire(hit)
        prefill.block_table = list(hit)
        prefill.block_keys = list(group.prompt_keys[: len(hit)])
        prefill.num_computed_tokens = group.cached_tokens = len(hit) * bs
        self.prefix_queries += prompt_len
        self.prefix_hits += group.cached_tokens
        seqs = [prefill]
        if group.params.n == 1:
            prefill.reserved_blocks = self.pool.blocks_for(last) - len(hit)
        else:
            prefill.reserved_blocks = self.pool.blocks_for(prompt_len) - len(hit)
            for child in group.samples:
                child.reserved_blocks = self.pool.blocks_for(last) - prompt_len // bs
                seqs.append(child)
        for seq in seqs:
            seq.status = SeqStatus.RUNNING
            self._seqs[seq.seq_id] = seq
            self._reserved += seq.reserved_blocks

    def _chunk(self, seq: Seq, num_tokens: int) -> ChunkPlan:
        start = seq.num_computed_tokens
        end = start + num_tokens
        self._grow(seq, end)
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
            token_ids=tuple(seq.token_ids[start:end]),
            start_pos=start,
            block_table=tuple(seq.block_table),
            samples=samples,
            score_ids=() if top is None else prompt[start + 1 : min(end + 1, len(prompt))],
            score_top=top or 0,
        )

    def _grow(self, seq: Seq, num_tokens: int) -> None:
        """Allocate from the sequence's reservation until its table covers ``num_tokens``."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return
        blocks = self.pool.allocate(need) if need <= seq.reserved_blocks else None
        if blocks is None:
            raise RuntimeError(f"seq {seq.seq_id} outgrew its KV reservation (a scheduler bug)")
        seq.block_table.extend(blocks)
        seq.reserved_blocks -= need
        self._reserved -= need

    def _fork(self, parent: Seq, child: Seq) -> None:
        prompt_len = len(child.group.prompt)
        fork = self.pool.fork(parent.block_table, prompt_len)
        if fork is None or len(fork.copies) > child.reserved_blocks:
            raise RuntimeError(f"seq {child.seq_id} could not fork its parent (a scheduler bug)")
        child.block_table = list(fork.block_table)
        child.block_keys = list(parent.block_keys[: prompt_len // self.pool.block_size])
        child.num_computed_tokens = prompt_len
        child.reserved_blocks -= len(fork.copies)
        self._reserved -= len(fork.copies)
        self._copies.extend((src, dst, child.seq_id) for src, dst in fork.copies)

    def _register(self, seq: Seq) -> None:
        """Key the blocks that became full (their KV is written once the step returned)."""
        bs = self.pool.block_size
        keys = seq.block_keys
        prompt_keys = seq.group.prompt_keys
        for i in range(len(keys), seq.num_computed_tokens // bs):
            if i < len(prompt_keys):
                key = prompt_keys[i]
            else:
                key = block_key(keys[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.register(seq.block_table[i], key)
            keys.append(key)

    def _keep(self, seq: Seq) -> None:
        """Pin the cached blocks of what ``seq`` computed, for its request's session."""
        blocks = self.pool.match(seq.block_keys)
        self.pool.acquire(blocks)
        num_tokens = len(blocks) * self.pool.block_size
        self._kept[seq.group.request_id] = KeptKV(
            token_ids=tuple(seq.token_ids[:num_tokens]),
            blocks=tuple(blocks),
            output_token_ids=tuple(seq.token_ids[len(seq.group.prompt) :]),
        )

    def _append(self, seq: Seq, token: SampledToken) -> SampleOutput:
        params = seq.params
        tid = token.token_id
        rid = seq.group.request_id
        index = seq.index if seq.index is not None else 0
        scores = token.prompt_logprobs
        if (not params.ignore_eos and tid in self.eos_token_ids) or tid in params.stop_token_ids:
            self._finish_seq(seq, keep=True)
            return SampleOutput(rid, index, None, FinishReason.STOP, scores)
        seq.token_ids.append(tid)
        if seq.num_output_tokens >= params.max_tokens:
            self._finish_seq(seq, keep=True)
            return SampleOutput(rid, index, token, FinishReason.LENGTH, scores)
        return SampleOutput(rid, index, token, None, scores)

    def _drop_seq(self, seq: Seq) -> None:
        """Free a sequence's blocks and reservation; it leaves the running set, and the
        runner is told to drop what it keeps for it (a sampler's generator, a prompt's
        scores) with the next plan."""
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        self._reserved -= seq.reserved_blocks
        seq.reserved_blocks = 0
        seq.status = SeqStatus.FINISHED
        if self._seqs.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)

    def _finish_seq(self, seq: Seq, *, keep: bool = False) -> None:
        """A sample ended: free it; the request leaves when its last sample does.

        ``keep`` (a natural end) pins the KV of a ``keep_kv`` request first.
        """
        group = seq.group
        if keep and group.keep_kv:
            self._keep(seq)
        self._drop_seq(seq)
        group.num_live -= 1
        self._num_slots -= 1
        if group.num_live == 0:
            if group.prefill is not None:
                self._drop_seq(group.prefill)
                group.prefill = None
            group.status = SeqStatus.FINISHED
            self.running.pop(group.request_id, None)
