"""What one step attends over: the step's flat token batch and the per-step attention
tensors every layer shares.

One :meth:`~furnace_trio.runtime.model.Transformer.forward` call runs a whole step: every
sequence contributes a chunk of new tokens (a whole prompt, a prefill chunk, or one decode
token) at its own position. The tokens of all chunks are concatenated into one flat batch
(:class:`StepInputs`) for the linear layers; only attention looks at sequences one by one,
and even there every single-token (decode) chunk of the step is attended in one batched
call (:class:`DecodeBatch`), and on CUDA every multi-token chunk too
(:class:`PrefillBatch`). Masks are additive (0 where a key is seen, ``-inf`` elsewhere),
built once per step: SDPA would convert a boolean mask in every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from furnace_trio.core.plan import StepPlan


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Tensors of one step, built by the runner from a :class:`~furnace_trio.core.plan.StepPlan`.

    Flat token dimension ``T`` (all chunks concatenated), row dimension ``B``: a row is a
    chunk, or one token of a short chunk that the runner split into one-token rows (each
    seeing the sequence up to its own token; see :func:`build_inputs`).

    - ``input_ids``, ``positions``, ``slot_mapping``: ``[T]`` int64.
    - ``query_starts``: offsets of each row in the flat batch (python ints, ``B + 1``).
    - ``context_lens``: tokens of each row's sequence that its queries see (``B``).
    - ``block_tables``: ``[B, max_blocks]`` int64, padded with block 0 (masked out).
    - ``decode_rows``: the rows of a single token; their attention runs in one batched
      call (``decode_index`` is the same as a tensor).
    - ``prefill_rows``: the other rows (chunks of more than one token), attended one by
      one, or on CUDA all in one call (``prefill``).
    - ``logit_rows``: flat token indices whose next-token logits are wanted.
    - ``decode``, ``prefill`` and ``chunk_masks`` (sequence index -> :func:`chunk_mask` of a
      multi-token chunk after cached tokens) are per-step attention tensors shared by every
      layer; :meth:`~furnace_trio.runtime.model.Transformer.forward` fills them in.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_starts: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: torch.Tensor
    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    decode_index: torch.Tensor
    decode_context_lens: torch.Tensor
    logit_rows: torch.Tensor
    decode: DecodeBatch | None = None
    prefill: PrefillBatch | None = None
    chunk_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Per-step tensors of the batched decode attention, shared by every layer.

    - ``tables``: ``[n, blocks]`` block tables of the decode sequences, cut to the blocks
      that the longest one needs.
    - ``max_ctx``: the longest decode context; ``mask``: ``[n, 1, 1, max_ctx]``,
      a key position is inside the sequence (additive: 0 inside, ``-inf`` outside);
      ``window_mask``: the same for sliding-window layers (also ``-inf`` before the
      window), ``None`` for models without them.
    - ``flat_rows``: flat token index of each decode query, ``None`` when the step is all
      decodes (rows ``0..n-1`` in order, so no gather/scatter is needed).
    """

    tables: torch.Tensor
    max_ctx: int
    mask: torch.Tensor
    flat_rows: torch.Tensor | None
    window_mask: torch.Tensor | None = None

    @staticmethod
    def build(
        inputs: StepInputs, block_size: int, dtype: torch.dtype, window: int | None = None
    ) -> DecodeBatch | None:
        if not inputs.decode_rows:
            return None
        device = inputs.block_tables.device
        max_ctx = max(inputs.context_lens[b] for b in inputs.decode_rows)  # no device sync
        max_blocks = -(-max_ctx // block_size)
        tables = inputs.block_tables[inputs.decode_index][:, :max_blocks].contiguous()
        keys = torch.arange(max_ctx, device=device)[None, :]
        lens = inputs.decode_context_lens[:, None]
        inside = keys < lens
        flat_rows = None
        if len(inputs.decode_rows) != len(inputs.context_lens):
            rows = [inputs.query_starts[b] for b in inputs.decode_rows]
            flat_rows = torch.tensor(rows, device=device)
        window_mask = None
        if window is not None:
            window_mask = _additive(inside & (keys >= lens - window), dtype)[:, None, None, :]
        return DecodeBatch(
            tables, max_ctx, _additive(inside, dtype)[:, None, None, :], flat_rows, window_mask
        )


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive float mask of a boolean one (0 where seen, ``-inf`` elsewhere): SDPA would
    convert a boolean mask in every layer."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
        ~seen, float("-inf")
    )


#: The most elements a batched prefill's mask (rows x queries x keys) and each of its
#: padded key and value copies (rows x keys x query heads x head size) may have; a step
#: with more attends its prefill rows one by one (128 MiB each in bfloat16).
PREFILL_BATCH_ELEMENTS = 1 << 26


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Per-step tensors of the batched prefill attention, shared by every layer: every
    multi-token row of the step in one attention call, its queries padded to the longest
    chunk (``width``) and its keys to the longest context (``span``).

    On a GPU a row attended on its own is about ten kernel launches per layer, so a step
    that starts 64 prompts launches some 19,000 for attention alone; padded into one call it
    is ten (figures in docs/history.md).

    - ``index``: ``[n, width]`` flat token index of each query (a short row repeats its
      last token; those queries are computed and dropped).
    - ``tables``: ``[n, blocks]`` block tables, cut to the blocks ``span`` needs.
    - ``mask``: ``[n, 1, width, span]`` additive: query ``i`` of a row that follows
      ``past`` cached tokens sees keys ``0 .. past + i`` of its own context;
      ``window_mask`` the same for sliding-window layers (keys after
      ``past + i - window``), ``None`` for models without them.
    - ``picked``: the real queries' places in the padded ``[n * width]`` output, in flat
      token order; ``flat``: their flat token indices.

    Every row reads its keys and values from the cache: with an int8 cache that includes
    a fresh prompt's own, rounded, which the per-row path uses as computed.
    """

    index: torch.Tensor
    tables: torch.Tensor
    span: int
    mask: torch.Tensor
    picked: torch.Tensor
    flat: torch.Tensor
    window_mask: torch.Tensor | None = None

    @staticmethod
    def build(
        inputs: StepInputs,
        block_size: int,
        dtype: torch.dtype,
        head_elements: int,
        window: int | None = None,
    ) -> PrefillBatch | None:
        """The batch of ``inputs``' prefill rows (``head_elements``: query heads x head
        size); ``None`` for fewer than two, or when its mask or key copies would exceed
        :data:`PREFILL_BATCH_ELEMENTS`."""
        rows = inputs.prefill_rows
        if len(rows) < 2:
            return None
        starts, ctxs = inputs.query_starts, inputs.context_lens
        lens = [starts[b + 1] - starts[b] for b in rows]
        n, width, span = len(rows), max(lens), max(ctxs[b] for b in rows)
        if n * span * max(width, head_elements) > PREFILL_BATCH_ELEMENTS:
            return None
        index: list[int] = []
        picked: list[int] = []
        flat: list[int] = []
        for r, (b, qlen) in enumerate(zip(rows, lens, strict=True)):
            lo = starts[b]
            index.extend(lo + min(i, qlen - 1) for i in range(width))
            picked.extend(range(r * width, r * width + qlen))
            flat.extend(range(lo, lo + qlen))
        pasts = [ctxs[b] - qlen for b, qlen in zip(rows, lens, strict=True)]
        spans = [ctxs[b] for b in rows]
        device = inputs.block_tables.device
        # One host-to-device copy for every index of the step.
        packed = torch.tensor(
            [*index, *picked, *flat, *pasts, *spans, *rows], dtype=torch.int64
        ).to(device)
        index_t, picked_t, flat_t, past_t, span_t, rows_t = packed.split(
            [n * width, len(picked), len(flat), n, n, n]
        )
        queries = torch.arange(width, device=device)[None, :, None]
        keys = torch.arange(span, device=device)[None, None, :]
        at = past_t[:, None, None] + queries
        seen = (keys <= at) & (keys < span_t[:, None, None])
        window_mask = None
        if window is not None:
            window_mask = _additive(seen & (keys > at - window), dtype)[:, None]
        tables = inputs.block_tables[rows_t][:, : -(-span // block_size)]
        return PrefillBatch(
            index_t.view(n, width),
            tables,
            span,
            _additive(seen, dtype)[:, None],
            picked_t,
            flat_t,
            window_mask,
        )


def chunk_mask(
    qlen: int, past: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Additive causal mask ``[qlen, past + qlen]`` of a chunk after ``past`` cached tokens.

    Query ``i`` (at position ``past + i``) sees keys ``0 .. past + i`` (with a sliding
    ``window``, only the last ``window`` of them): 0 there, ``-inf`` elsewhere. Built once
    per step for every layer; SDPA would convert a boolean mask each call.
    """
    rows = torch.arange(qlen, device=device)[:, None] + past
    keys = torch.arange(past + qlen, device=device)[None, :]
    seen = keys <= rows
    if window is not None:
        seen &= keys > rows - window
    return _additive(seen, dtype)


def build_inputs(
    plan: StepPlan,
    block_size: int,
    device: torch.device,
    *,
    all_rows: bool = False,
    split_upto: int = 0,
) -> StepInputs:
    """Flatten a plan's chunks into the tensors of :class:`StepInputs`.

    Logits are computed only for the last token of chunks that sample (or of every chunk
    with ``all_rows``), and for the positions a chunk scores (``score_ids``, before its
    sampling row): the vocabulary projection is the largest matrix of a small model.

    A chunk of at most ``split_upto`` tokens becomes that many rows of one token each, row
    ``i`` seeing the sequence up to its own token (context ``start_pos + i + 1``), as if
    the tokens were decoded one by one: every key and value of a step is in the cache
    before any attention reads it, so this is the chunk's causal attention, run by the
    decode path (one fused native call when every row is one token).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    logit_rows: list[int] = []
    tables: list[Sequence[int]] = []
    for chunk in plan.chunks:
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"chunk of sequence {chunk.seq_id} has no tokens")
        end = chunk.start_pos + n
        if len(chunk.block_table) * block_size < end:
            raise ValueError(
                f"block table of sequence {chunk.seq_id} covers "
                f"{len(chunk.block_table) * block_size} positions, needs {end}"
            )
        first = len(ids)
        ids.extend(chunk.token_ids)
        table = chunk.block_table
        for pos in range(chunk.start_pos, end):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        rows = range(chunk.start_pos + 1, end + 1) if n <= split_upto else (end,)
        for context in rows:
            context_lens.append(context)
            tables.append(table)
            starts.append(starts[-1] + n // len(rows))
        # A scored chunk's positions first (each predicts the next prompt token), then
        # the row it samples from, if any (its last position, which no score takes).
        if chunk.score_ids:
            logit_rows.extend(range(first, first + len(chunk.score_ids)))
        if chunk.num_drafts and chunk.samples:  # the last real token's and each draft's
            logit_rows.extend(range(first + n - 1 - chunk.num_drafts, first + n))
        elif all_rows or chunk.samples:
            logit_rows.append(starts[-1] - 1)
    # A row of one token decodes (batched attention); a longer one is a prefill chunk.
    decode_rows = [b for b in range(len(tables)) if starts[b + 1] - starts[b] == 1]
    prefill_rows = tuple(b for b in range(len(tables)) if starts[b + 1] - starts[b] > 1)
    width = max(len(t) for t in tables)
    decode_context_lens = [context_lens[b] for b in decode_rows]
    # Every integer tensor of the step from one list: one tensor (one copy to the device)
    # and views of it, rather than seven tensors (a visible share of a CPU decode step).
    parts = (ids, positions, slots, decode_rows, decode_context_lens, logit_rows)
    flat = [v for part in parts for v in part]
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    sizes = [len(part) for part in parts] + [len(tables) * width]
    packed = torch.tensor(flat, dtype=torch.int64, device=device).split(sizes)
    return StepInputs(
        input_ids=packed[0],
        positions=packed[1],
        slot_mapping=packed[2],
        query_starts=tuple(starts),
        context_lens=tuple(context_lens),
        block_tables=packed[6].view(len(tables), width),
        decode_rows=tuple(decode_rows),
        prefill_rows=prefill_rows,
        decode_index=packed[3],
        decode_context_lens=packed[4],
        logit_rows=packed[5],
    )
