"""CUDA graphs of the all-decode step: one replay instead of about 1,200 launches from Python.

On a GPU a decode step of the torch path is some 1,200 small kernels, each launched from
Python (about 10 us apiece), so without graphs a step's time is its launch count, whatever
the batch (docs/history.md has the figures). A CUDA graph records a step's kernels
once and replays them with one call. A graph fixes every shape and address, so:

- **Shapes come in buckets.** A step of ``n`` decodes runs the graph of the smallest batch
  size in :data:`BATCH_SIZES` that holds ``n``; the extra rows are padding. Attention reads
  each sequence's keys in a padded range whose width is the smallest of ``16, 32, 64 ...``
  blocks that holds the longest context of the step (the mask hides the rest). One graph
  per (batch size, width): the server captures every batch size at the narrowest width
  before it serves (:meth:`DecodeGraphs.warm_up`), any other the first time a step needs it.
- **Inputs live in one static buffer** (token ids, positions, cache slots, context lengths,
  block tables), refilled from the host with one copy per step; the graph reads it in place.
- **Padding rows write their keys and values to a scratch block** that no sequence owns
  (the runner allocates one block more than it hands out) and attend to one key, so they
  never touch a sequence's cache and never make a NaN.

The forward pass is :class:`~furnace_trio.runtime.model.Transformer`'s own torch path, unchanged:
the graph is fed a :class:`~furnace_trio.runtime.step_inputs.StepInputs` whose tensors are
views of the static buffer and whose Python context lengths all say the bucket's width.
Steps with a prefill chunk, or more decodes than the largest batch size, run eagerly,
without a graph.

A capture that fails (out of memory, an op that cannot be captured) is logged and turns
the graphs off for the runner's life: every step then runs op by op, as with
``FURNACE_CUDA_GRAPHS=0``, and the server goes on serving.

Without CUDA (``capture=False``) the same padded, static-buffer step runs eagerly: what
the CPU tests check, everything but the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from furnace_trio.core.plan import StepPlan
from furnace_trio.runtime.kv_cache import KVCache
from furnace_trio.runtime.model import Transformer
from furnace_trio.runtime.step_inputs import StepInputs

logger = logging.getLogger(__name__)

#: The batch sizes that get a graph; a step of more decodes than the last runs eagerly.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
#: The narrowest attention range, in blocks; each wider one doubles it.
MIN_WIDTH_BLOCKS = 16


def batch_bucket(n: int) -> int | None:
    """The smallest of :data:`BATCH_SIZES` that holds ``n`` decodes (``None``: too many)."""
    return next((size for size in BATCH_SIZES if size >= n), None)


def context_widths(max_context: int, block_size: int) -> tuple[int, ...]:
    """The attention widths (tokens, whole blocks) from 16 blocks up, doubling, the last
    one the first that holds ``max_context``."""
    top = -(-max_context // block_size) * block_size
    widths = [min(MIN_WIDTH_BLOCKS * block_size, top)]
    while widths[-1] < top:
        widths.append(min(2 * widths[-1], top))
    return tuple(widths)


@dataclass(frozen=True, slots=True)
class _Graph:
    """One (batch size, width) step: ``replay`` returns float32 logits ``[batch, vocab]``.

    ``inputs`` is kept alive with it: a graph reads their tensors by address, and one made
    outside the capture (the row indices) would otherwise be freed and its memory reused.
    """

    batch: int
    width: int
    replay: Callable[[], torch.Tensor]
    inputs: StepInputs


class DecodeGraphs:
    """The captured decode steps of one model and cache (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        max_context: int,
        scratch_block: int,
        capture: bool,
    ) -> None:
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache")
        self._model = model
        self._cache = cache
        self._block_size = cache.block_size
        self._scratch_slot = scratch_block * cache.block_size
        self.widths = context_widths(max_context, cache.block_size)
        self._device = cache.k.device
        most, blocks = BATCH_SIZES[-1], self.widths[-1] // cache.block_size
        self._static = torch.zeros(most * (4 + blocks), dtype=torch.int64, device=self._device)
        self._capture = capture
        self._pool: Any = None  # the memory pool every graph shares (made at the first capture)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        #: False once a capture failed: every step runs op by op from then on.
        self.enabled = True
        # The rotary table is grown (reallocated) on demand: grow it to the widest range now,
        # so that no graph keeps the address of a table that was replaced.
        model.reserve_rotary(self.widths[-1])

    @property
    def captured(self) -> tuple[tuple[int, int], ...]:
        """The (batch size, width) of every graph made so far, in order."""
        return tuple(self._graphs)

    def warm_up(self, most: int) -> None:
        """Capture every batch size up to the one that holds ``most`` sequences, at the
        narrowest width, now (as vLLM does at startup) rather than in a client's time."""
        top = batch_bucket(most) or BATCH_SIZES[-1]
        for batch in BATCH_SIZES:
            if batch <= top and self.enabled and (batch, self.widths[0]) not in self._graphs:
                self._make(batch, self.widths[0])

    def accepts(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is all one-token chunks, few enough for a graph."""
        chunks = plan.chunks
        return (
            self.enabled
            and bool(chunks)
            and len(chunks) <= BATCH_SIZES[-1]
            and all(len(c.token_ids) == 1 for c in chunks)
        )

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Float32 logits after every chunk of ``plan`` that samples, in order; ``None`` if
        its graph could not be captured (the caller runs the step op by op)."""
        chunks = plan.chunks
        n = len(chunks)
        batch = batch_bucket(n)
        longest = max(c.start_pos for c in chunks) + 1
        width = next((w for w in self.widths if w >= longest), None)
        if batch is None or width is None:
            raise ValueError(f"no decode graph for {n} sequences with a context of {longest}")
        graph = self._graphs.get((batch, width)) or self._make(batch, width)
        if graph is None:
            return None
        self._fill(plan, batch, width)
        logits = graph.replay()
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if len(rows) == n:
            return logits[:n]
        return logits.index_select(0, torch.tensor(rows, device=logits.device))

    def _fill(self, plan: StepPlan, batch: int, width: int) -> None:
        """Copy ``plan``'s inputs into the static buffer, laid out for (batch, width)."""
        size = self._block_size
        blocks = width // size
        pad = batch - len(plan.chunks)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        tables: list[int] = []
        for chunk in plan.chunks:
            pos = chunk.start_pos
            table = chunk.block_table
            if len(table) * size <= pos:
                raise ValueError(
                    f"block table of sequence {chunk.seq_id} covers {len(table) * size} "
                    f"positions, needs {pos + 1}"
                )
            ids.append(chunk.token_ids[0])
            positions.append(pos)
            slots.append(table[pos // size] * size + pos % size)
            lens.append(pos + 1)
            row = list(table[:blocks])
            tables.extend(row)
            tables.extend([0] * (blocks - len(row)))
        flat = [
            *ids,
            *[0] * pad,
            *positions,
            *[0] * pad,
            *slots,
            *[self._scratch_slot] * pad,
            *lens,
            *[1] * pad,
            *tables,
            *[0] * (pad * blocks),
        ]
        host = torch.tensor(flat, dtype=torch.int64)
        self._static[: len(flat)].copy_(host)

    def _inputs(self, batch: int, width: int) -> StepInputs:
        """The step inputs of (batch, width): views of the static buffer."""
        s = self._static
        blocks = width // self._block_size
        every = torch.arange(batch, device=self._device)
        return StepInputs(
            input_ids=s[:batch],
            positions=s[batch : 2 * batch],
            slot_mapping=s[2 * batch : 3 * batch],
            query_starts=tuple(range(batch + 1)),
            # Python ints read only for the attention range: the bucket's width for all.
            context_lens=(width,) * batch,
            block_tables=s[4 * batch : 4 * batch + batch * blocks].view(batch, blocks),
            decode_rows=tuple(range(batch)),
            prefill_rows=(),
            decode_index=every,
            decode_context_lens=s[3 * batch : 4 * batch],
            logit_rows=every,
        )

    def _make(self, batch: int, width: int) -> _Graph | None:
        inputs = self._inputs(batch, width)
        # Until the first fill: every row is padding (scratch slot, one key).
        empty = StepPlan(())
        self._fill(empty, batch, width)
        model, cache = self._model, self._cache

        def step() -> torch.Tensor:
            return model(inputs, cache)

        if not self._capture:
            graph = _Graph(batch, width, step, inputs)
        else:
            started = time.perf_counter()
            try:
                graph = _Graph(batch, width, self._record(step), inputs)
            except Exception as exc:  # whatever the cause, the step can run op by op
                self.enabled = False
                logger.warning(
                    "decode graphs off: capturing %d sequences, %d tokens wide failed (%s: %s);"
                    " every step runs op by op",
                    batch,
                    width,
                    type(exc).__name__,
                    exc,
                )
                return None
            took = (time.perf_counter() - started) * 1e3
            logger.info(
                "decode graph captured: %d sequences, %d tokens wide, %.0f ms", batch, width, took
            )
        self._graphs[(batch, width)] = graph
        return graph

    def _record(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture ``step`` into a CUDA graph (after one warm-up run on a side stream, as
        torch asks); the replay returns the tensor the captured step produced.

        ``capture_begin``/``capture_end`` rather than ``torch.cuda.graph``, which runs a full
        ``gc.collect()`` and empties the allocator's cache at every capture; neither is
        needed here, and a capture during serving would pay for both.
        """
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            step()
            side.synchronize()
            # thread_local: the Trio thread may touch CUDA (memory stats) meanwhile.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = step()
            finally:
                graph.capture_end()
        main.wait_stream(side)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
