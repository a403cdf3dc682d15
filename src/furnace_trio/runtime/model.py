"""The Llama-family (and Gemma 3) decoder, and its forward pass over a paged KV cache.

One :meth:`Transformer.forward` call runs a whole step (:class:`~.step_inputs.StepInputs`):
the tokens of every sequence's chunk in one flat batch through the linear layers, attention
per row (:mod:`.attention`). The modules:

- :mod:`.step_inputs`: the step's batch and the per-step attention tensors and masks;
- :mod:`.kv_cache`: the paged keys and values (:class:`~.kv_cache.KVCache`);
- :mod:`.layers`: weights' source, linear, RMSNorm, rotary embedding, MLP;
- :mod:`.attention`, :mod:`.decoder_layer`: a layer's attention, and the layer;
- this module: the model, its rotary tables, and the torch forward path;
- :mod:`.native_forward`: the float32 CPU path through the native kernels, per layer or
  every layer of an all-decode step in one call.

Gemma 3 is the same pass with its differences switched on by :class:`ModelConfig`: four
norms per layer, GELU, a scaled embedding, its own attention scale, and sliding-window
layers with a rotary base of their own (the window is a mask on the torch path and a
start position in the native decode-attention kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import cast

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from furnace_trio.loading.model_config import MTP_PREFIX, ModelConfig
from furnace_trio.runtime import native, native_forward
from furnace_trio.runtime.attention import CUDA_ATTENTION
from furnace_trio.runtime.decoder_layer import DecoderLayer
from furnace_trio.runtime.kv_cache import KVCache
from furnace_trio.runtime.layers import MLP, RMSNorm, WeightSource, rope_inv_freq
from furnace_trio.runtime.mtp import MTPHead
from furnace_trio.runtime.step_inputs import DecodeBatch, PrefillBatch, StepInputs, chunk_mask


class Transformer(nn.Module):
    """A Llama-family decoder built from Hugging Face-named weights.

    The constructor asks ``weights`` for every weight, one at a time, in their runtime form
    (so a load holds the weights built so far plus one in conversion); names it never
    asked for are an error, since they mean a weight was not used. ``mtp``: build the
    file's multi-token-prediction layer (:attr:`mtp`) where it has one; else its weights
    are left unread.
    """

    inv_freq: torch.Tensor
    inv_freq_local: torch.Tensor

    def __init__(self, config: ModelConfig, weights: WeightSource, *, mtp: bool = False) -> None:
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
        #: The multi-token-prediction layer (runtime/mtp.py), when asked for and present.
        self.mtp: MTPHead | None = None
        if mtp and config.mtp_layers:
            self.mtp = MTPHead(config, weights)
        elif config.mtp_layers:
            weights.drop(MTP_PREFIX)
        #: Keep each step's last residual stream (every row) in :attr:`hidden`, for the
        #: multi-token-prediction layer (set by its drafter).
        self.capture_hidden = False
        self.hidden: torch.Tensor | None = None
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
        # compare with the per-op path); use_native says whether the layers allow it.
        self.fused_decode = True
        self._fusable = False
        # The all-decode step in one native call: its shapes and address table.
        self._fused = native_forward.FusedDecode(config)

    def use_native(self, kernels: native.Kernels | None) -> None:
        """Run float32 CPU steps with the native kernels (``None``: torch only).

        Decode attention always goes native then, and so do the elementwise ops between
        the linears (:func:`~.native_forward.run_layers`), except in a mixture of experts;
        an all-decode step runs every layer in one call where the layers are Llama-shaped
        (no q/k norms, sandwich norms, GELU or sliding windows).
        """
        if kernels is not None and self.config.num_heads // self.config.num_kv_heads > 64:
            kernels = None  # the kernel keeps at most 64 query heads per KV head
        for module in self.layers:
            cast(DecoderLayer, module).self_attn.kernels = kernels
        if self.mtp is not None:
            self.mtp.block.self_attn.kernels = kernels
        c = self.config
        native_layers = kernels is not None and c.moe is None
        self.kernels = (
            kernels if native_layers and self.embed_tokens.dtype == torch.float32 else None
        )
        self._fusable = not (
            c.qk_norm
            or c.sandwich_norms
            or c.hidden_activation != "silu"
            or c.embedding_multiplier != 1.0
            or c.final_logit_softcapping is not None
            or any(c.sliding_layers)
        )
        self._fused = native_forward.FusedDecode(self.config)

    @property
    def attends_natively(self) -> bool:
        """Whether one-token rows are attended by the native decode-attention kernel
        (:meth:`use_native` gave the layers kernels)."""
        return cast(DecoderLayer, self.layers[0]).self_attn.kernels is not None

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(logit_rows), vocab]``."""
        kernels = self.kernels  # set only for float32 CPU runners (use_native)
        all_decodes = len(inputs.decode_rows) == len(inputs.context_lens)
        if kernels is not None and all_decodes and self.fused_decode and self._fusable:
            logits = self._forward_fused_decode(inputs, cache, kernels)
            if logits is not None:
                return logits
        inputs = self._with_decode_batch(inputs, cache, self._window)
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
        if self.capture_hidden:
            self.hidden = x
        x = self.norm(x[inputs.logit_rows])
        logits = self.lm_head(x).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _forward_native(
        self, inputs: StepInputs, cache: KVCache, kernels: native.Kernels
    ) -> torch.Tensor:
        """:meth:`forward` with a layer's elementwise work fused into native calls
        (:func:`~.native_forward.run_layers`)."""
        x = self.embed_tokens(inputs.input_ids)  # a fresh tensor: updated in place
        if self._embedding_multiplier != 1.0:
            x.mul_(self._embedding_multiplier)
        end = max(inputs.context_lens)
        cos, sin = self._rotary(inputs.positions, end)
        local = self._rotary(inputs.positions, end, local=True) if self._local_rope else None
        layers = [cast(DecoderLayer, m) for m in self.layers]
        eps = self.config.rms_norm_eps
        native_forward.run_layers(layers, x, cos, sin, cache, inputs, kernels, eps, local)
        if self.capture_hidden:
            self.hidden = x
        logits = native_forward.final_logits(
            x, inputs.logit_rows, self.norm, self.lm_head, eps, kernels
        )
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _forward_fused_decode(
        self, inputs: StepInputs, cache: KVCache, kernels: native.Kernels
    ) -> torch.Tensor | None:
        """An all-decode step through every layer in one native call (native int8,
        Q4_1 or Q8_0 linears only; ``None`` otherwise). Same kernels, same order as
        :meth:`_forward_native`."""
        ptrs = self._decode_layer_ptrs(cache, kernels)
        if ptrs is None:
            return None
        x = self.embed_tokens(inputs.input_ids)
        cos, sin = self._rotary(inputs.positions, max(inputs.context_lens))
        intermediate = cast(MLP, cast(DecoderLayer, self.layers[0]).mlp).intermediate
        self._fused.run(ptrs, intermediate, x, cos, sin, inputs, cache, kernels)
        if self.capture_hidden:
            self.hidden = x
        eps = self.config.rms_norm_eps
        return native_forward.final_logits(
            x, inputs.logit_rows, self.norm, self.lm_head, eps, kernels
        )

    def final_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """The last step's hidden states at ``rows`` after the final norm (what the LM head
        reads; the step ran with :attr:`capture_hidden`)."""
        if self.hidden is None:
            raise RuntimeError("no hidden states kept: capture_hidden was off")
        picked = self.hidden.index_select(0, rows)
        if self.kernels is None:
            return self.norm(picked)
        normed = torch.empty_like(picked)
        self.kernels.add_rmsnorm(picked, None, self.norm.weight, self.config.rms_norm_eps, normed)
        return normed

    def mtp_forward(self, hidden: torch.Tensor, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """The multi-token-prediction layer's output at every row of ``inputs`` (one-token
        rows; their tokens are the next tokens), from ``hidden`` (one row each), writing
        its keys and values to ``cache`` (its one-layer cache)."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its multi-token-prediction layer")
        inputs = self._with_decode_batch(inputs, cache, None)
        embeds = self.embed_tokens(inputs.input_ids)
        cos, sin = self._rotary(inputs.positions, max(inputs.context_lens))
        fusable = self._fusable and self.fused_decode
        return self.mtp(hidden, embeds, cos, sin, cache, inputs, self.kernels, fusable=fusable)

    def _with_decode_batch(
        self, inputs: StepInputs, cache: KVCache, window: int | None
    ) -> StepInputs:
        """``inputs`` with the batch of its one-token rows (:class:`DecodeBatch`) built."""
        if inputs.decode is not None or not inputs.decode_rows:
            return inputs
        decode = DecodeBatch.build(inputs, cache.block_size, self.embed_tokens.dtype, window)
        return dataclasses.replace(inputs, decode=decode)

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
        """The address table of the fused decode call for ``cache``, or ``None`` when a
        layer's linears are not native ones (:meth:`~.native_forward.FusedDecode.layer_ptrs`)."""
        return self._fused.layer_ptrs(self.layers, cache, kernels)

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
