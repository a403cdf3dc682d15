"""Admission and step planning: which tokens of which sequences run in the next model step.

Plain Python (no Trio, no torch), in the style of vLLM v1: a sequence has ``token_ids``
(prompt, then output) and ``num_computed_tokens`` (how many of them are in the KV cache).
There is no prefill or decode phase: a step runs ``token_ids[num_computed_tokens:]`` of a
sequence, or a chunk of it, and samples when the chunk reaches the end of the tokens.

Each :meth:`Scheduler.schedule` builds one :class:`~furnace_trio.core.plan.StepPlan` within
``max_step_tokens``, in this order:

1. every running sequence that is decoding gets its one next token (running streams never
   wait behind a prompt for more than one step),
2. sequences still prefilling get their next prompt chunk, oldest first (chunked prefill;
   with running decodes, ``pacer`` may cap the prefill to fit a step time, engine/pacing.py),
3. waiting requests are admitted first come first served while there is budget, a free
   sequence slot (``max_running``) and enough unreserved KV blocks; the queue head is never
   overtaken, so a large request is not starved by small ones.

Memory: admission asks the :class:`~furnace_trio.engine.kv_cache_manager.KVCacheManager`
for the request's worst case of KV blocks (reservation, no preemption: a sequence, once
admitted, can always finish). The manager keeps the block tables, the prefix-cache
matches, the forks and the pins; the scheduler only decides what runs.

Speculative decoding (:mod:`~furnace_trio.engine.speculation`): a decoding sequence's
chunk may carry drafts after its last token; the speculator settles what was accepted.

``n > 1``: a *parent* sequence runs the prompt once; its last chunk samples ``n`` children
(their own seq ids, ``seed + index`` when seeded so that they differ). Each child that goes
on forks the parent's blocks, then the parent lets go of its blocks.

Prefix cache: at admission the prompt's cached prefix becomes the start of the request's
KV (:mod:`~furnace_trio.engine.admission`), so only the rest is computed.

Sessions: a request added with ``keep_kv`` pins, when it finishes naturally, the cached
blocks of everything it computed (:class:`KeptKV`, taken with :meth:`Scheduler.pop_kept`);
an aborted or failed request keeps nothing. When the queue head does not fit, the
``reclaim`` hook (the engine's session store) may drop pins and admission tries again.

Pauses (:meth:`Scheduler.pause`): a paused request keeps its KV blocks and its running slot
but gets no chunk until :meth:`Scheduler.resume` (its client stopped reading; see
:mod:`~furnace_trio.engine.backlog`).

Aborts (:meth:`Scheduler.abort`) are synchronous and free blocks at once. That is safe
while a step is in flight: blocks are only handed out again by the next ``schedule()``,
which runs after that step has returned; :meth:`Scheduler.update` ignores tokens of
sequences that are gone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampledToken, StepPlan
from furnace_trio.engine.admission import WaitingQueue, allocate, start_running
from furnace_trio.engine.chunk_plan import plan_chunk
from furnace_trio.engine.kv_cache_manager import KeptKV, KVCacheManager
from furnace_trio.engine.pacing import StepPacer
from furnace_trio.engine.sequence import Group, Seq, SeqStatus, new_group
from furnace_trio.engine.speculation import SpeculationConfig, Speculator, answers
from furnace_trio.engine.step_outputs import FinishReason, SampleOutput, ScheduledStep, StepMismatch

__all__ = ["FinishReason", "SampleOutput", "ScheduledStep", "Scheduler", "StepMismatch"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Waiting queue and running requests; their KV lives in the :class:`KVCacheManager`."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_running: int,
        max_step_tokens: int,
        max_context: int,
        eos_token_ids: Iterable[int],
        speculation: SpeculationConfig | None = None,
    ) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        if max_step_tokens < max_running:
            raise ValueError("max_step_tokens must be at least max_running (one token each)")
        if max_context < 2:
            raise ValueError("max_context must be at least 2")
        self.kv = kv
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator: Speculator | None = None
        if speculation is not None and speculation.enabled:
            self.speculator = Speculator(speculation)
        self.waiting = WaitingQueue()
        self.running: dict[str, Group] = {}  # insertion order == admission order
        self._seqs: dict[int, Seq] = {}  # running sequences by seq id
        self._next_seq_id = 0
        self._num_slots = 0  # live samples of running requests
        self._released: list[int] = []
        self._kept: dict[str, KeptKV] = {}
        #: Called with the number of blocks missing when the queue head does not fit; may
        #: free pinned blocks (sessions). Admission then tries once more.
        self.reclaim: Callable[[int], None] | None = None
        self.pacer: StepPacer | None = None  # sizes prefill by step time (engine/pacing.py)

    # -- sizes ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_sequences(self) -> int:
        """Samples of the waiting requests (``n`` per request): what they will run as."""
        return self.waiting.num_samples

    @property
    def num_running(self) -> int:
        """Sequences holding a running slot (``n`` per request)."""
        return self._num_slots

    @property
    def num_paused(self) -> int:
        """Running requests that take no steps until resumed."""
        return sum(group.paused for group in self.running.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Worst-case KV blocks of a request: what admission reserves."""
        return self.kv.blocks_needed(num_prompt_tokens, params)

    def is_waiting(self, request_id: str) -> bool:
        """Queued, not yet admitted."""
        return self.waiting.has(request_id)

    def contains(self, request_id: str) -> bool:
        return request_id in self.running or self.waiting.has(request_id)

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
        blocks_needed = self.blocks_needed(len(prompt), params)
        keys = self.kv.prompt_keys(prompt)
        group = new_group(request_id, prompt, params, blocks_needed, keys, self._next_seq_id)
        group.keep_kv = keep_kv
        self._next_seq_id += params.n + (params.n > 1)
        self.waiting.append(group)

    def abort(self, request_id: str, *, keep: bool = False) -> bool:
        """Drop a request in any state, freeing its blocks now. Whether it was known.

        ``keep``: the request ended normally (a stop string), so a ``keep_kv`` request
        still pins its KV; a plain abort (disconnect, failure) pins nothing.
        """
        group = self.waiting.remove(request_id)
        if group is not None:
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

    def pause(self, request_id: str) -> bool:
        """Give a running request no more chunks (its KV stays); whether it runs."""
        group = self.running.get(request_id)
        if group is None:
            return False
        group.paused = True
        return True

    def resume(self, request_id: str) -> None:
        """Let a paused request take steps again; nothing if it is gone."""
        group = self.running.get(request_id)
        if group is not None:
            group.paused = False

    def pop_kept(self, request_id: str) -> KeptKV | None:
        """The pins a finished ``keep_kv`` request left; the caller owns (and frees) them."""
        return self._kept.pop(request_id, None)

    # -- planning ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """The next step, or ``None`` when there is nothing to run."""
        budget = self.max_step_tokens
        chunks: list[ChunkPlan] = []
        request_ids: list[str] = []
        # 1. one token for every decoding sequence, and its drafts (speculation)
        decoding: list[Seq] = []
        for group in self.running.values():
            if group.paused:
                continue
            if group.prefill is not None and group.prefill.num_computed_tokens < len(group.prompt):
                continue
            request_ids.append(group.request_id)
            decoding.extend(seq for seq in group.samples if seq.status is SeqStatus.RUNNING)
        num_decode = len(decoding)
        budget -= num_decode
        drafts = self.speculator.propose_all(decoding, budget) if self.speculator else {}
        num_drafts = 0
        for seq in decoding:
            proposed = drafts.get(seq.seq_id, ())
            chunks.append(self._chunk(seq, len(seq.token_ids) - seq.num_computed_tokens, proposed))
            num_drafts += len(proposed)
        budget -= num_drafts
        if self.pacer is not None:  # draft rows cost as decode rows do
            budget = self.pacer.prefill_budget(num_decode + num_drafts, budget)
        granted = budget
        # 2. prompt chunks of running requests, oldest first
        for group in self.running.values():
            if budget <= 0:
                break
            prefill = group.prefill
            if group.paused or prefill is None or prefill.num_computed_tokens >= len(group.prompt):
                continue
            take = min(len(group.prompt) - prefill.num_computed_tokens, budget)
            chunks.append(self._chunk(prefill, take))
            request_ids.append(group.request_id)
            budget -= take
        # 3. admission, first come first served
        admitted: list[str] = []
        cached: list[int] = []
        while budget > 0 and self.waiting:
            group = self.waiting.head
            # n > max_running only after max_running was lowered while it waited: it runs
            # alone rather than never
            over = self._num_slots + group.params.n > self.max_running
            if (over and (self._num_slots or group.params.n <= self.max_running)) or not (
                self._admit(group)
            ):
                break
            admitted.append(group.request_id)
            cached.append(group.cached_tokens)
            request_ids.append(group.request_id)
            assert group.prefill is not None
            take = min(len(group.prompt) - group.prefill.num_computed_tokens, budget)
            chunks.append(self._chunk(group.prefill, take))
            budget -= take
        if not chunks:
            return None
        released, self._released = tuple(self._released), []
        copies = self.kv.take_block_copies()
        plan = StepPlan(chunks=tuple(chunks), block_copies=copies, released=released)
        return ScheduledStep(
            plan=plan,
            admitted=tuple(admitted),
            cached_tokens=tuple(cached),
            request_ids=tuple(request_ids),
            num_prefill_tokens=granted - budget,
            num_decode_tokens=num_decode,
            num_draft_tokens=num_drafts,
        )

    # -- results ----------------------------------------------------------------------------

    def update(self, step: ScheduledStep, sampled: Sequence[SampledToken]) -> list[SampleOutput]:
        """Apply a step's results: advance the counters, append tokens, detect the ends.

        Raises :class:`StepMismatch` (changing nothing) when ``sampled`` does not answer the plan's
        samples exactly; the caller then fails the plan's requests like a raising step.
        """
        try:
            by_seq = answers(step.plan, sampled)
        except ValueError as exc:
            raise StepMismatch(str(exc)) from None
        outputs: list[SampleOutput] = []
        for chunk in step.plan.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            if chunk.num_drafts:
                outputs.extend(self._verified(seq, chunk, by_seq[seq.seq_id]))
                continue
            seq.num_computed_tokens = num_computed = chunk.start_pos + len(chunk.token_ids)
            self.kv.cache_blocks(seq.kv, seq.token_ids, num_computed)
            if not chunk.samples:
                continue
            group = seq.group
            if seq.index is not None:
                outputs.append(self._append(seq, by_seq[seq.seq_id][0]))
                continue
            # the parent of n > 1: each child that goes on forks the prompt's blocks
            for spec in chunk.samples:
                child = self._seqs.get(spec.seq_id)
                if child is None:
                    continue
                output = self._append(child, by_seq[child.seq_id][0])
                outputs.append(output)
                if output.finish is None:
                    self._fork(seq, child)
            self._drop_seq(seq)
            group.prefill = None
        return outputs

    def request_of(self, seq_id: int) -> str | None:
        """The request of a running sequence; ``None`` once it is gone."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.group.request_id

    def narrow(self, step: ScheduledStep, plan: StepPlan) -> ScheduledStep:
        """``step`` cut down to ``plan``, a subset of its chunks that ran after ``step``
        raised (see :mod:`~furnace_trio.engine.isolation`), for :meth:`update`. The step's
        releases go out again with the next plan: the re-runs may not have delivered them,
        and a release is idempotent."""
        self._released.extend(step.plan.released)
        kept = {self.request_of(chunk.seq_id) for chunk in plan.chunks}
        request_ids = tuple(rid for rid in step.request_ids if rid in kept)
        return dataclasses.replace(step, plan=plan, request_ids=request_ids)

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

    def _admit(self, group: Group) -> bool:
        """Admit the queue head if the KV cache manager has room for it, asking ``reclaim``
        once for what is missing; whether it was admitted."""
        blocks, computed = allocate(self.kv, group)
        if blocks is None and self.reclaim is not None:
            self.reclaim(self.kv.shortage(group.blocks_needed, computed))
            blocks, _ = allocate(self.kv, group)
        if blocks is None:
            return False
        self.waiting.popleft()
        self.running[group.request_id] = group
        self._num_slots += group.params.n
        for seq in start_running(group, blocks):
            self._seqs[seq.seq_id] = seq
        return True

    def _chunk(self, seq: Seq, num_tokens: int, drafts: tuple[int, ...] = ()) -> ChunkPlan:
        return plan_chunk(self.kv, seq, num_tokens, drafts)

    def _fork(self, parent: Seq, child: Seq) -> None:
        prompt_len = len(child.group.prompt)
        if not self.kv.fork(parent.kv, child.kv, prompt_len):
            raise RuntimeError(f"seq {child.seq_id} could not fork its parent (a scheduler bug)")
        child.num_computed_tokens = prompt_len

    def _verified(
        self, seq: Seq, chunk: ChunkPlan, tokens: Sequence[SampledToken]
    ) -> list[SampleOutput]:
        """Apply a drafted chunk's verified ``tokens``: the KV of the last token and of the
        accepted drafts stays computed, the rejected drafts' blocks go back to the
        reservation, and the tokens are appended up to the first that ends the sample."""
        assert self.speculator is not None  # only its chunks have drafts
        kept, accepted = self.speculator.settle(seq, chunk, tokens, self.kv, self.eos_token_ids)
        outputs = [self._append(seq, token) for token in kept]
        outputs[0] = dataclasses.replace(outputs[0], drafted=chunk.num_drafts, accepted=accepted)
        return outputs

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
        self.kv.free(seq.kv)
        seq.status = SeqStatus.FINISHED
        if self._seqs.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)

    def _finish_seq(self, seq: Seq, *, keep: bool = False) -> None:
        """A sample ended: free it; the request leaves when its last sample does.

        ``keep`` (a natural end) pins the KV of a ``keep_kv`` request first.
        """
        group = seq.group
        if keep and group.keep_kv:
            self._kept[group.request_id] = self.kv.pin(seq.kv, seq.token_ids, len(group.prompt))
        self._drop_seq(seq)
        group.num_live -= 1
        self._num_slots -= 1
        if group.num_live == 0:
            if group.prefill is not None:
                self._drop_seq(group.prefill)
                group.prefill = None
            group.status = SeqStatus.FINISHED
            self.running.pop(group.request_id, None)
