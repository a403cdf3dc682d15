"""The float32 CPU forward through the native kernels (``cpu_kernels.c``).

The same layers, weights and KV cache as the torch path of
:class:`~furnace_trio.runtime.model.Transformer`, with the elementwise work between the
linears fused into native calls:

- :func:`run_layers`, any step: per layer, the residual add and the next norm are one call,
  as are the rotary embedding and the cache writes (:func:`attention`), and the SiLU gate
  (:func:`mlp`); the linears and the attention are the layers' own modules.
- :class:`FusedDecode`, an all-decode step whose linears are all native ones: every layer
  in one call (``furnace_decode_layers``), the same kernels in the same order.
- :func:`final_logits`: the final norm (native) and the LM head, for the rows that need
  logits.

:func:`run_layers` also takes what Gemma 3 and Qwen3 add: q/k norms (one native call
before the rotary embedding), sandwich norms (two native norm calls where Llama has one),
the GELU gate, and a second rotary table for sliding-window layers (the window itself is
the decode-attention kernel's). :class:`FusedDecode` takes Llama-shaped layers only
(:meth:`~furnace_trio.runtime.model.Transformer.use_native` decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime import native
from furnace_trio.runtime.attention import Attention
from furnace_trio.runtime.decoder_layer import DecoderLayer
from furnace_trio.runtime.kv_cache import KVCache, LayerKV
from furnace_trio.runtime.layers import MLP, RMSNorm
from furnace_trio.runtime.quant import NativeLinear
from furnace_trio.runtime.step_inputs import StepInputs


def attention(
    attn: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: LayerKV,
    inputs: StepInputs,
    kernels: native.Kernels,
) -> torch.Tensor:
    """``attn``'s forward with its q/k norms (where it has them), and the rotary embedding
    and the cache writes, each in one native call (float32, float16 or int8 CPU caches);
    ``cos``/``sin`` are ``[T, D]``."""
    tokens = x.shape[0]
    qkv = attn.qkv_proj(x)
    if attn.q_norm is not None and attn.k_norm is not None:
        kernels.head_rmsnorm(
            qkv,
            attn.num_heads,
            attn.num_kv_heads,
            attn.q_norm.weight,
            attn.k_norm.weight,
            attn.q_norm.eps,
        )
    q = torch.empty((tokens, attn.num_heads, attn.head_dim))
    k = torch.empty((tokens, attn.num_kv_heads, attn.head_dim))
    kernels.rope_store(qkv, cos, sin, inputs.slot_mapping, kv.k, kv.v, q, k, kv.scales)
    v = qkv.view(tokens, -1, attn.head_dim)[:, attn.num_heads + attn.num_kv_heads :]
    return attn.attend(q, k, v, kv, inputs)


def mlp(block: MLP, x: torch.Tensor, kernels: native.Kernels) -> torch.Tensor:
    """``block``'s forward with the SiLU (or GELU) gate in one native call."""
    act = torch.empty((x.shape[0], block.intermediate))
    if block.gelu:
        kernels.gelu_mul(block.gate_up_proj(x), act)
    else:
        kernels.silu_mul(block.gate_up_proj(x), act)
    return block.down_proj(act)


def run_layers(
    layers: Sequence[DecoderLayer],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    inputs: StepInputs,
    kernels: native.Kernels,
    eps: float,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Every layer over the embeddings ``x`` (a fresh tensor: updated in place to the
    residual stream after the last layer); ``local``: the sliding-window layers' ``cos`` and
    ``sin`` where they have a table of their own."""
    normed = torch.empty_like(x)
    sandwich = layers[0].pre_feedforward_layernorm is not None
    outer = torch.empty_like(x) if sandwich else normed
    kernels.add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps, normed)
    for i, layer in enumerate(layers):
        c, s = local if local is not None and layer.self_attn.window is not None else (cos, sin)
        h = attention(layer.self_attn, normed, c, s, cache.layers[i], inputs, kernels)
        pre_mlp, post_mlp = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
        if pre_mlp is None or post_mlp is None:
            kernels.add_rmsnorm(x, h, layer.post_attention_layernorm.weight, eps, normed)
        else:  # x += norm2(h), then the MLP's own input norm
            kernels.add_rmsnorm(h, None, layer.post_attention_layernorm.weight, eps, outer)
            kernels.add_rmsnorm(x, outer, pre_mlp.weight, eps, normed)
        # dense layers only: a mixture of experts never gets the native kernels
        h = mlp(cast(MLP, layer.mlp), normed, kernels)
        if post_mlp is not None:  # the MLP's output normed before the residual add
            kernels.add_rmsnorm(h, None, post_mlp.weight, eps, outer)
            h = outer
        if i + 1 < len(layers):
            kernels.add_rmsnorm(x, h, layers[i + 1].input_layernorm.weight, eps, normed)
        else:
            x.add_(h)


def final_logits(
    x: torch.Tensor,
    rows: torch.Tensor,
    norm: RMSNorm,
    head: nn.Module,
    eps: float,
    kernels: native.Kernels,
) -> torch.Tensor:
    """The final norm (native: torch's took 0.2 ms for one row) and the LM head, for the
    ``rows`` of the residual stream ``x`` that need logits."""
    # rows rise one per chunk: as many as x has is every row, in order (all decodes)
    picked = x if len(rows) == x.shape[0] else x.index_select(0, rows)
    normed = torch.empty_like(picked)
    kernels.add_rmsnorm(picked, None, norm.weight, eps, normed)
    return head(normed).float()


class FusedDecode:
    """An all-decode step through every layer in one native call (native int8, Q4_1 or
    Q8_0 linears only), for one model: the shapes the call takes and the address table of
    its weights and cache, made on first use and kept (asked every step)."""

    def __init__(self, config: ModelConfig) -> None:
        self._config = config
        # The shapes furnace_decode_layers takes (made on the first fused step).
        self._dims: native.DecodeDims | None = None
        # Weight and cache addresses: (cache, pointers), pointers None when the linears
        # are not native ones.
        self._layer_ptrs: tuple[KVCache, torch.Tensor | None] | None = None

    def layer_ptrs(
        self, layers: nn.ModuleList, cache: KVCache, kernels: native.Kernels
    ) -> torch.Tensor | None:
        """The address table of ``furnace_decode_layers`` for ``cache``, or ``None`` when a
        layer's linears are not native int8, 4-bit or Q8_0 ones (float32 weights, fbgemm)."""
        if self._layer_ptrs is not None and self._layer_ptrs[0] is cache:
            return self._layer_ptrs[1]
        rows: list[int] = []
        for i, module in enumerate(layers):
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
        if len(rows) != kernels.layer_ptrs * len(layers):
            raise RuntimeError("native layer table does not match cpu_kernels.c")
        table = torch.tensor(rows, dtype=torch.int64)
        self._layer_ptrs = (cache, table)
        return table

    def run(
        self,
        ptrs: torch.Tensor,
        intermediate: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inputs: StepInputs,
        cache: KVCache,
        kernels: native.Kernels,
    ) -> None:
        """Every layer over the embeddings ``x`` of an all-decode step, in place (``ptrs``:
        :meth:`layer_ptrs`; ``intermediate``: the MLP's width)."""
        c = self._config
        if self._dims is None:
            self._dims = native.DecodeDims(
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                intermediate,
                c.rms_norm_eps,
            )
        kernels.decode_layers(
            ptrs,
            self._dims,
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
