"""Self-attention of one layer over the paged KV cache.

A step's queries are attended in up to three ways, all writing one output tensor:
single-token (decode) rows in one batched call (the native decode-attention kernel on the
CPU, else SDPA over the gathered blocks), multi-token rows one by one, or on CUDA all of
them in one padded call. Sliding-window layers (Gemma 3) take the windowed masks on the
torch path and a start position in the native kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime import native
from furnace_trio.runtime.kv_cache import LayerKV
from furnace_trio.runtime.layers import RMSNorm, WeightSource, apply_rotary
from furnace_trio.runtime.step_inputs import PrefillBatch, StepInputs, chunk_mask

#: The attention kernels a step may use on CUDA: every SDPA backend but cuDNN's, which
#: torch prefers on Hopper and which builds a plan for every new shape (tens of milliseconds
#: each). A server's shapes change with every prompt length, context and batch
#: size; flash, memory-efficient and math kernels take any shape at no cost. (torch keeps
#: this choice process-wide, set and restored around each step: the server runs every step
#: on its one model thread.)
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)

        kv.store(inputs.slot_mapping, k, v)
        return self.attend(q, k, v, kv, inputs)

    def attend(
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
