"""The Llama-family (and Gemma 3) forward pass over a paged KV cache.

One :meth:`Transformer.forward` call runs a whole step: every sequence contributes a chunk of
new tokens (a whole prompt, a prefill chunk, or one decode token) at its own position. The
tokens of all chunks are concatenated into one flat batch for the linear layers (the bulk of
the work); only attention looks at sequences one by one, and even there every single-token
(decode) chunk of the step is attended in one batched call.

KV layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at
position ``p`` of a sequence with block table ``bt`` lives in slot
``bt[p // block_size] * block_size + p % block_size`` of the flattened ``[slots, kv, dim]``
view, which is where :class:`StepInputs.slot_mapping` points.

Projections are fused (q/k/v into one matrix, gate/up into one) so a step makes few, large
matrix products; :class:`Linear` is the single place a quantized kernel plugs in.

Gemma 3 is the same pass with its differences switched on by :class:`ModelConfig`: four
norms per layer, GELU, a scaled embedding, its own attention scale, and sliding-window
layers with a rotary base of their own (the window is a mask on the torch path and a
start position in the native decode-attention kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime import native
from furnace_trio.runtime.embedding import Embedding
from furnace_trio.runtime.moe import SparseMoE
from furnace_trio.runtime.quant import NativeLinear


class WeightSource(Protocol):
    """Where the model's modules take their weights, by Hugging Face name, each already in
    its runtime form (:class:`~furnace_trio.runtime.build.WeightBuilder`): asked for in
    model order, one at a time, so the source can convert each as it goes."""

    def tensor(self, name: str) -> torch.Tensor: ...

    def linear(self, kind: str, names: Sequence[str], biases: Sequence[str] = ()) -> nn.Module: ...

    def embedding(self) -> Embedding: ...

    def head(self, tied: bool) -> nn.Module: ...

    def unused(self) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Tensors of one step, built by the runner from a :class:`~furnace_trio.core.plan.StepPlan`.

    Flat token dimension ``T`` (all chunks concatenated), row dimension ``B``: a row is a
    chunk, or one token of a short chunk that the runner split into one-token rows (each
    seeing the sequence up to its own token; see :func:`~furnace_trio.runtime.runner.build_inputs`).

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
      layer; :meth:`Transformer.forward` fills them in.
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


#: The attention kernels a step may use on CUDA: every SDPA backend but cuDNN's, which
#: torch prefers on Hopper and which builds a plan for every new shape (tens of milliseconds
#: each). A server's shapes change with every prompt length, context and batch
#: size; flash, memory-efficient and math kernels take any shape at no cost. (torch keeps
#: this choice process-wide, set and restored around each step: the server runs every step
#: on its one model thread.)
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    expand_kv: bool,
) -> torch.Tensor:
    """Causal attention of ``qlen`` queries ``[qlen, H, D]`` over ``ctx`` keys and values
    ``[ctx, KV, D]``; ``mask`` is ``None`` for a fresh prompt (plain causal) or the additive
    :func:`chunk_mask` when the chunk follows cached tokens.

    Inputs are 4-D with ``enable_gqa``: with 3-D inputs or an expanded (``repeat_interleave``)
    key copy, torch 2.13 on the CPU takes the unfused math path, several times slower.
    On CUDA the other way round for a masked chunk (``expand_kv``): no fused kernel takes a
    mask with ``enable_gqa``, and the math kernel it falls back to is slow for a step of
    many prefix-cached prompts; with the keys expanded the memory-efficient kernel takes it.
    """
    qh = q.transpose(0, 1)[None]  # [1, H, qlen, D]
    kh = keys.transpose(0, 1)[None]  # [1, KV, ctx, D]
    vh = values.transpose(0, 1)[None]
    if expand_kv:
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=not expand_kv,
    )
    return o[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's paged keys and values, ``[blocks, block_size, KV, D]``: float, or int8
    with ``scales``, one float32 per (slot, KV head) each for keys and values
    (``[blocks, block_size, KV]``; a value is ``q * scale``)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: native.KVScales | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` ``[T, KV, D]`` at cache ``slots`` ``[T]``."""
        kv_heads, dim = self.k.shape[2:]
        if self.scales is None:
            self.k.view(-1, kv_heads, dim).index_copy_(0, slots, k.to(self.k.dtype))
            self.v.view(-1, kv_heads, dim).index_copy_(0, slots, v.to(self.v.dtype))
            return
        for cache, scale, x in ((self.k, self.scales[0], k), (self.v, self.scales[1], v)):
            q, s = native.quantize_kv_rows(x)
            cache.view(-1, kv_heads, dim).index_copy_(0, slots, q)
            scale.view(-1, kv_heads).index_copy_(0, slots, s)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the block numbers ``blocks`` (any shape) as ``dtype``:
        ``[*blocks.shape, block_size, KV, D]`` each."""
        keys, values = self.k[blocks].to(dtype), self.v[blocks].to(dtype)
        if self.scales is not None:
            keys = keys * self.scales[0][blocks].to(dtype).unsqueeze(-1)
            values = values * self.scales[1][blocks].to(dtype).unsqueeze(-1)
        return keys, values


class KVCache:
    """Preallocated paged key/value storage for every layer, written in place.

    ``dtype`` float32, float16 or bfloat16; or int8, one scale per (slot, KV head) row
    beside it (see :class:`LayerKV`): about half a float16 cache's bytes per token.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scales: native.KVScales | None = None
        if dtype == torch.int8:
            scale_shape = shape[:-1]
            self.scales = (
                torch.zeros(scale_shape, dtype=torch.float32, device=device),
                torch.zeros(scale_shape, dtype=torch.float32, device=device),
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [
            LayerKV(
                self.k[i],
                self.v[i],
                None if self.scales is None else (self.scales[0][i], self.scales[1][i]),
            )
            for i in range(config.num_layers)
        ]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        row = config.head_dim * element + (4 if dtype == torch.int8 else 0)  # + int8's scale
        return 2 * config.num_layers * block_size * config.num_kv_heads * row

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write after a fork)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k.device)
        dst = torch.tensor([d for _, d in copies], device=self.k.device)
        for tensor in (self.k, self.v, *(self.scales or ())):
            tensor[:, dst] = tensor[:, src]


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with the weight stored as given (``[out, in]``).

    The seam for faster kernels: a quantized replacement keeps this call signature.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm, ``x * rsqrt(mean(x^2) + eps) * w``, computed in float32.

    One op (``F.rms_norm``) instead of five in float32 and eight in float16 or bfloat16,
    where torch upcasts internally: on a GPU, where a decode step's time is the number of
    ops it launches, the two norms were over a quarter of a layer's ops. In half precision
    torch's CPU kernel rounds once, after the weight, where Hugging Face's Llama rounds
    before it too: the two differ by at most one unit in the last place.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 or linear scaling when the config asks for it;
    ``local``: those of the sliding-window layers (``rope_local_theta``, never scaled)."""
    dim = config.head_dim
    theta = config.rope_theta
    if local and config.rope_local_theta is not None:
        theta = config.rope_local_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not local and config.rope_linear_factor != 1.0:
        inv_freq = inv_freq / config.rope_linear_factor
    if config.longrope is not None:  # Phi-3's per-frequency divisors, every layer
        inv_freq = inv_freq / torch.tensor(config.longrope.factors, dtype=torch.float64)
    scaling = config.rope_scaling
    if scaling is None or local:
        return inv_freq.float()
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three ops.

    ``rotate_half(x) = cat(-x2, x1)`` is ``roll(x, half) * [-1.., +1..]``; the sign is folded
    into ``signed_sin`` once per step (:meth:`Transformer.forward`).
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, signed_sin)


class Attention(nn.Module):
    """Self-attention of one layer; ``window``: its sliding window (``None``: it sees the
    whole context)."""

    def __init__(
        self, config: ModelConfig, weights: WeightSource, prefix: str, window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.scale
        self.window = window
        # The native decode-attention kernel (float32, float16 or int8 CPU caches), set by
        # Transformer.use_native.
        self.kernels: native.Kernels | None = None
        names = [f"{prefix}.self_attn.{p}_proj" for p in ("q", "k", "v")]
        biases = [f"{n}.bias" for n in names] if config.attention_bias else []
        self.qkv_proj = weights.linear("qkv_proj", [f"{n}.weight" for n in names], biases)
        self.o_proj = weights.linear("o_proj", [f"{prefix}.self_attn.o_proj.weight"])
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(weights.tensor(f"{prefix}.self_attn.q_norm.weight"), eps)
            self.k_norm = RMSNorm(weights.tensor(f"{prefix}.self_attn.k_norm.weight"), eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerKV,
        inputs: StepInputs,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads = self.num_heads + self.num_kv_heads
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(tokens, heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Rotary embedding of queries and keys in one pass (they share positions).
        qk = _apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)

        kv.store(inputs.slot_mapping, k, v)
        return self._attend(q, k, v, kv, inputs)

    def forward_native(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerKV,
        inputs: StepInputs,
        kernels: native.Kernels,
    ) -> torch.Tensor:
        """:meth:`forward` with the rotary embedding and the cache writes in one native call
        (float32, float16 or int8 CPU caches, no q/k norm); ``cos``/``sin`` are ``[T, D]``."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = torch.empty((tokens, self.num_heads, self.head_dim))
        k = torch.empty((tokens, self.num_kv_heads, self.head_dim))
        kernels.rope_store(qkv, cos, sin, inputs.slot_mapping, kv.k, kv.v, q, k, kv.scales)
        v = qkv.view(tokens, -1, self.head_dim)[:, self.num_heads + self.num_kv_heads :]
        return self._attend(q, k, v, kv, inputs)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        inputs: StepInputs,
    ) -> torch.Tensor:
        """Attention of this step's rotated queries (keys/values already in the cache), then
        the output projection."""
        tokens = q.shape[0]
        block_size = kv.block_size
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if inputs.decode_rows:
            self._attend_decodes(q, out, kv, inputs)
            if len(inputs.decode_rows) == len(inputs.context_lens):
                return self.o_proj(out.view(tokens, self.q_size))
        if inputs.prefill is not None:
            self._attend_prefills(q, out, kv, inputs.prefill)
            return self.o_proj(out.view(tokens, self.q_size))
        starts = inputs.query_starts
        for b in inputs.prefill_rows:
            ctx = inputs.context_lens[b]
            lo, hi = starts[b], starts[b + 1]
            qlen = hi - lo
            past = ctx - qlen
            # A window shorter than the context needs a mask of its own (per layer).
            window = self.window if self.window is not None and ctx > self.window else None
            mask = None
            if past == 0:
                keys, values = k[lo:hi], v[lo:hi]
            else:
                blocks = inputs.block_tables[b, : -(-ctx // block_size)]
                keys, values = kv.gather(blocks, q.dtype)
                keys, values = keys.flatten(0, 1)[:ctx], values.flatten(0, 1)[:ctx]
                mask = inputs.chunk_masks.get(b)
            if window is not None:
                mask = chunk_mask(qlen, past, q.dtype, q.device, window)
            elif past and mask is None:
                mask = chunk_mask(qlen, past, q.dtype, q.device)
            out[lo:hi] = self._attend_chunk(q[lo:hi], keys, values, mask)
        return self.o_proj(out.view(tokens, self.q_size))

    def _attend_chunk(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal attention of ``qlen`` new queries over ``past + qlen`` keys (see
        :func:`chunk_attention`); on CUDA a masked chunk's keys are expanded per query head."""
        expand = mask is not None and q.is_cuda
        return chunk_attention(q, keys, values, mask, self.scale, expand_kv=expand)

    def _attend_prefills(
        self, q: torch.Tensor, out: torch.Tensor, kv: LayerKV, p: PrefillBatch
    ) -> None:
        """One attention call for every prefill row of the step (see :class:`PrefillBatch`);
        the keys are repeated per query head, as no fused kernel takes a mask with
        ``enable_gqa``."""
        n, width = p.index.shape
        group = self.num_heads // self.num_kv_heads
        keys, values = kv.gather(p.tables, q.dtype)  # [n, blocks, block_size, KV, D]
        keys = keys.flatten(1, 2)[:, : p.span].transpose(1, 2).repeat_interleave(group, dim=1)
        values = values.flatten(1, 2)[:, : p.span].transpose(1, 2).repeat_interleave(group, dim=1)
        mask = p.mask if self.window is None else p.window_mask
        o = F.scaled_dot_product_attention(
            q[p.index].transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale
        )  # [n, H, width, D]
        o = o.transpose(1, 2).reshape(n * width, self.num_heads, self.head_dim)
        out.index_copy_(0, p.flat, o.index_select(0, p.picked))

    def _attend_decodes(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv: LayerKV,
        inputs: StepInputs,
    ) -> None:
        """One attention call for every single-token chunk of the step.

        Each sequence's blocks are gathered into a padded ``[n, max_ctx]`` key range; the
        query heads of one KV head are laid along the query axis, so grouped-query attention
        needs no copy of the keys per query head. Everything that depends only on the step
        (tables, mask, rows) is computed once per step in :class:`DecodeBatch`.
        """
        d = inputs.decode
        if d is None:
            return
        n = d.tables.shape[0]
        if self.kernels is not None and native.supports_kv(kv.k, kv.scales):
            qd = (q if d.flat_rows is None else q[d.flat_rows]).contiguous()
            target = out if d.flat_rows is None else torch.empty_like(qd)
            self.kernels.paged_decode_attention(
                qd,
                kv.k,
                kv.v,
                d.tables,
                inputs.decode_context_lens,
                self.scale,
                target,
                kv.scales,
                self.window,
            )
            if d.flat_rows is not None:
                out[d.flat_rows] = target
            return
        group = self.num_heads // self.num_kv_heads
        keys, values = kv.gather(d.tables, q.dtype)
        keys = keys.flatten(1, 2)[:, : d.max_ctx]  # [n, ctx, KV, D]
        values = values.flatten(1, 2)[:, : d.max_ctx]
        qd = q if d.flat_rows is None else q[d.flat_rows]
        o = F.scaled_dot_product_attention(
            qd.reshape(n, self.num_kv_heads, group, self.head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=d.mask if self.window is None else d.window_mask,
            scale=self.scale,
        )
        o = o.reshape(n, self.num_heads, self.head_dim)
        if d.flat_rows is None:
            out.copy_(o)
        else:
            out[d.flat_rows] = o


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))``, SiLU or GELU (tanh approximation)."""

    def __init__(self, config: ModelConfig, weights: WeightSource, prefix: str) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gelu = config.hidden_activation == "gelu_tanh"
        names = [f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"]
        self.gate_up_proj = weights.linear("gate_up_proj", names)
        self.down_proj = weights.linear("down_proj", [f"{prefix}.mlp.down_proj.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)

    def forward_native(self, x: torch.Tensor, kernels: native.Kernels) -> torch.Tensor:
        act = torch.empty((x.shape[0], self.intermediate))
        kernels.silu_mul(self.gate_up_proj(x), act)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    """One layer. Llama: ``x += attn(norm(x)); x += mlp(norm2(x))``, where
    ``post_attention_layernorm`` is the MLP's input norm. With ``sandwich_norms`` (Gemma 3)
    the outputs are normed too: ``x += norm2(attn(norm(x))); x += norm4(mlp(norm3(x)))``,
    ``post_attention_layernorm`` being ``norm2``."""

    def __init__(self, config: ModelConfig, weights: WeightSource, i: int) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = Attention(config, weights, prefix, config.window(i))
        self.post_attention_layernorm = RMSNorm(
            weights.tensor(f"{prefix}.post_attention_layernorm.weight"), eps
        )
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(
                weights.tensor(f"{prefix}.pre_feedforward_layernorm.weight"), eps
            )
        # A mixture of experts where the config has one (runtime/moe.py).
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, weights, prefix) if config.sparse(i) else MLP(config, weights, prefix)
        )
        if config.sandwich_norms:
            self.post_feedforward_layernorm = RMSNorm(
                weights.tensor(f"{prefix}.post_feedforward_layernorm.weight"), eps
            )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerKV,
        inputs: StepInputs,
    ) -> torch.Tensor:
        """The residual stream after this layer (the torch path)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv, inputs)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    """A Llama-family decoder built from Hugging Face-named weights.

    The constructor asks ``weights`` for every weight, one at a time, in their runtime form
    (so a load holds the weights built so far plus one in conversion); names it never
    asked for are an error, since they mean a weight was not used.
    """

    inv_freq: torch.Tensor
    inv_freq_local: torch.Tensor

    def __init__(self, config: ModelConfig, weights: WeightSource) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = weights.embedding()
        # The head right after the embedding it may be made of, while little else is held.
        head = weights.head(config.tie_word_embeddings)
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(weights.tensor("model.norm.weight"), config.rms_norm_eps)
        self.lm_head = head
        leftover = weights.unused()
        if leftover:
            raise ValueError(f"unused weights: {', '.join(leftover[:5])}")
        device = self.embed_tokens.device
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        local = rope_inv_freq(config, local=True).to(device)
        self.register_buffer("inv_freq_local", local, persistent=False)
        # Sliding-window layers with rotary frequencies of their own (Gemma 3: another base,
        # never scaled) take the second table.
        self._local_rope = any(config.sliding_layers) and not torch.equal(local, self.inv_freq)
        # The window of the sliding layers, for the per-step decode and prefill masks.
        self._window = config.sliding_window if any(config.sliding_layers) else None
        # The embeddings' scale as the model's dtype rounds it (Gemma 3; 1 elsewhere).
        multiplier = torch.tensor(config.embedding_multiplier, dtype=torch.float32)
        self._embedding_multiplier = float(multiplier.to(self.embed_tokens.dtype))
        # cos and sin of every position below the largest seen so far (see _rotary), for
        # the global layers and the sliding ones
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
        # The fused native layer path (float32 on the CPU), set by use_native.
        self.kernels: native.Kernels | None = None
        # All-decode steps through every layer in one native call (tests turn it off to
        # compare with the per-op path).
        self.fused_decode = True
        # The shapes furnace_decode_layers takes (made on the first fused step).
        self._decode_dims: native.DecodeDims | None = None
        # Weight and cache addresses for furnace_decode_layers: (cache, pointers), pointers
        # None when the linears are not native ones (remembered: asked every step).
        self._layer_ptrs: tuple[KVCache, torch.Tensor | None] | None = None

    def use_native(self, kernels: native.Kernels | None) -> None:
        """Run float32 CPU steps with the native kernels (``None``: torch only).

        Decode attention always goes native then; the fused layer path (norms, rotary
        embedding and cache writes, SiLU) too, except for models with q/k norms (Gemma 3
        among them): those run the torch path's elementwise ops between native linears and
        native attention.
        """
        if kernels is not None and self.config.num_heads // self.config.num_kv_heads > 64:
            kernels = None  # the kernel keeps at most 64 query heads per KV head
        for module in self.layers:
            cast(DecoderLayer, module).self_attn.kernels = kernels
        c = self.config
        fused = kernels is not None and not (
            c.qk_norm
            or c.sandwich_norms
            or c.hidden_activation != "silu"
            or c.embedding_multiplier != 1.0
            or c.final_logit_softcapping is not None
            or any(c.sliding_layers)
            or c.moe is not None
        )
        self.kernels = kernels if fused and self.embed_tokens.dtype == torch.float32 else None
        self._layer_ptrs = None

    @property
    def attends_natively(self) -> bool:
        """Whether one-token rows are attended by the native decode-attention kernel
        (:meth:`use_native` gave the layers kernels)."""
        return cast(DecoderLayer, self.layers[0]).self_attn.kernels is not None

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(logit_rows), vocab]``."""
        kernels = self.kernels  # set only for float32 CPU runners (use_native)
        all_decodes = len(inputs.decode_rows) == len(inputs.context_lens)
        if kernels is not None and all_decodes and self.fused_decode:
            logits = self._forward_fused_decode(inputs, cache, kernels)
            if logits is not None:
                return logits
        if inputs.decode is None and inputs.decode_rows:
            decode = DecodeBatch.build(
                inputs, cache.block_size, self.embed_tokens.dtype, self._window
            )
            inputs = dataclasses.replace(inputs, decode=decode)
        on_cuda = self.embed_tokens.device.type == "cuda"
        if inputs.prefill is None and on_cuda and len(inputs.prefill_rows) > 1:
            heads = self.config.num_heads * self.config.head_dim
            batch = PrefillBatch.build(
                inputs, cache.block_size, self.embed_tokens.dtype, heads, self._window
            )
            inputs = dataclasses.replace(inputs, prefill=batch)
        if not inputs.chunk_masks and inputs.prefill is None:
            inputs = dataclasses.replace(inputs, chunk_masks=self._chunk_masks(inputs))
        if kernels is not None:
            return self._forward_native(inputs, cache, kernels)
        x = self.embed_tokens(inputs.input_ids)
        if self._embedding_multiplier != 1.0:
            x = x * self._embedding_multiplier
        end = max(inputs.context_lens)
        cos, sin = self._rotary(inputs.positions, end)
        cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
        local_cos, local_sin = cos, sin
        if self._local_rope:
            local_cos, local_sin = self._rotary(inputs.positions, end, local=True)
            local_cos, local_sin = (
                local_cos.to(x.dtype)[:, None, :],
                local_sin.to(x.dtype)[:, None, :],
            )
        attention = sdpa_kernel(CUDA_ATTENTION) if on_cuda else contextlib.nullcontext()
        with attention:
            for i, module in enumerate(self.layers):
                layer = cast(DecoderLayer, module)
                if layer.self_attn.window is None:
                    x = layer(x, cos, sin, cache.layers[i], inputs)
                else:
                    x = layer(x, local_cos, local_sin, cache.layers[i], inputs)
        x = self.norm(x[inputs.logit_rows])
        logits = self.lm_head(x).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _forward_native(
        self, inputs: StepInputs, cache: KVCache, kernels: native.Kernels
    ) -> torch.Tensor:
        """:meth:`forward` with a layer's elementwise work fused into native calls: the
        residual add and the next norm are one call, as are the rotary embedding and the
        cache writes, and the SiLU gate."""
        x = self.embed_tokens(inputs.input_ids)  # a fresh tensor: updated in place
        cos, sin = self._rotary(inputs.positions, max(inputs.context_lens))
        layers = [cast(DecoderLayer, m) for m in self.layers]
        eps = self.config.rms_norm_eps
        normed = torch.empty_like(x)
        kernels.add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps, normed)
        for i, layer in enumerate(layers):
            h = layer.self_attn.forward_native(normed, cos, sin, cache.layers[i], inputs, kernels)
            kernels.add_rmsnorm(x, h, layer.post_attention_layernorm.weight, eps, normed)
            h = layer.mlp.forward_native(normed, kernels)
            if i + 1 < len(layers):
                kernels.add_rmsnorm(x, h, layers[i + 1].input_layernorm.weight, eps, normed)
            else:
                x.add_(h)
        return self._native_logits(x, inputs.logit_rows, kernels)

    def _forward_fused_decode(
        self, inputs: StepInputs, cache: KVCache, kernels: native.Kernels
    ) -> torch.Tensor | None:
        """An all-decode step through every layer in one native call (native int8,
        Q4_1 or Q8_0 linears only; ``None`` otherwise). Same kernels, same order as :meth:`_forward_native`."""
        ptrs = self._decode_layer_ptrs(cache, kernels)
        if ptrs is None:
            return None
        x = self.embed_tokens(inputs.input_ids)
        cos, sin = self._rotary(inputs.positions, max(inputs.context_lens))
        c = self.config
        if self._decode_dims is None:
            mlp = cast(DecoderLayer, self.layers[0]).mlp
            self._decode_dims = native.DecodeDims(
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                mlp.intermediate,
                c.rms_norm_eps,
            )
        kernels.decode_layers(
            ptrs,
            self._decode_dims,
            x,
            cos,
            sin,
            inputs.slot_mapping,
            inputs.block_tables,
            inputs.decode_context_lens,
            cache.block_size,
            c.scale,
            native.kv_kind(cache.k, cache.scales),
        )
        return self._native_logits(x, inputs.logit_rows, kernels)

    def _native_logits(
        self, x: torch.Tensor, rows: torch.Tensor, kernels: native.Kernels
    ) -> torch.Tensor:
        """The final norm (native: torch's took 0.2 ms for one row) and the LM head, for the
        ``rows`` of the residual stream ``x`` that need logits."""
        # rows rise one per chunk: as many as x has is every row, in order (all decodes)
        picked = x if len(rows) == x.shape[0] else x.index_select(0, rows)
        normed = torch.empty_like(picked)
        kernels.add_rmsnorm(picked, None, self.norm.weight, self.config.rms_norm_eps, normed)
        return self.lm_head(normed).float()

    def reserve_rotary(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table (``cos``, signed ``sin``, one row per position), grown now to
        hold every position below ``end``: rows of every position below the largest ``end``
        seen so far, grown by doubling. A CUDA graph keeps the table's address, so
        :class:`~furnace_trio.runtime.cuda_graphs.DecodeGraphs` reserves the widest range first
        (the sliding-window layers' table, where they have one, is grown with it)."""
        if self._local_rope:
            self._rope_local = self._grown(self._rope_local, self.inv_freq_local, end)
        self._rope = self._grown(self._rope, self.inv_freq, end)
        return self._rope

    def _grown(
        self, table: tuple[torch.Tensor, torch.Tensor] | None, inv_freq: torch.Tensor, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``table`` (of ``inv_freq``), or a new one when it has no row for ``end - 1``."""
        if table is not None and table[0].shape[0] >= end:
            return table
        size = max(end, 2 * table[0].shape[0] if table is not None else 256)
        size = min(size, max(end, self.config.max_position_embeddings))
        at = torch.arange(size, dtype=torch.float32, device=inv_freq.device)
        freqs = at[:, None] * inv_freq[None, :]
        sin_half = freqs.sin()
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin_half, sin_half), dim=-1)
        if self.config.longrope is not None:  # LongRoPE scales queries and keys
            factor = self.config.longrope.attention_factor
            cos, sin = cos * factor, sin * factor
        return cos, sin

    def _rotary(
        self, positions: torch.Tensor, end: int, *, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[T, head_dim]`` at ``positions`` (all below ``end``), the sign
        of rotate_half folded into ``sin``: two lookups in :meth:`reserve_rotary`'s table per
        step instead of the seven small ops that would compute them; ``local``: the
        sliding-window layers' table."""
        cos, sin = self.reserve_rotary(end)
        if local and self._rope_local is not None:
            cos, sin = self._rope_local
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _decode_layer_ptrs(self, cache: KVCache, kernels: native.Kernels) -> torch.Tensor | None:
        """The address table of ``furnace_decode_layers`` for ``cache``, or ``None`` when a
        layer's linears are not native int8, 4-bit or Q8_0 ones (float32 weights, fbgemm)."""
        if self._layer_ptrs is not None and self._layer_ptrs[0] is cache:
            return self._layer_ptrs[1]
        rows: list[int] = []
        for i, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            linears = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            for linear in linears:
                if not isinstance(linear, NativeLinear):
                    self._layer_ptrs = (cache, None)
                    return None
                rows += linear.table_row()
            rows += [
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                cache.k[i].data_ptr(),
                cache.v[i].data_ptr(),
                *((0, 0) if cache.scales is None else (s[i].data_ptr() for s in cache.scales)),
            ]
        if len(rows) != kernels.layer_ptrs * len(self.layers):
            raise RuntimeError("native layer table does not match cpu_kernels.c")
        table = torch.tensor(rows, dtype=torch.int64)
        self._layer_ptrs = (cache, table)
        return table

    def _chunk_masks(self, inputs: StepInputs) -> dict[int, torch.Tensor]:
        """The additive mask of every multi-token chunk that follows cached tokens."""
        masks: dict[int, torch.Tensor] = {}
        starts = inputs.query_starts
        for b, ctx in enumerate(inputs.context_lens):
            qlen = starts[b + 1] - starts[b]
            if qlen > 1 and ctx > qlen:
                dtype, device = self.embed_tokens.dtype, self.embed_tokens.device
                masks[b] = chunk_mask(qlen, ctx - qlen, dtype, device)
        return masks
