"""A multi-token-prediction (MTP) layer: a model's own draft head.

MiMo (Xiaomi's models on Qwen2's architecture) ships one beside its decoder, trained to
predict the token after next. At position ``j`` it takes the decoder's hidden state
``h_j`` (after the final norm) and the embedding of the next token ``t(j+1)``, and gives a
hidden state whose logits, through the model's own LM head, predict ``t(j+2)``::

    x   = input_proj(cat(hidden_layernorm(h_j), token_layernorm(embed(t(j+1)))))
    x   = block(x)                    a decoder layer (Qwen2's) at position j
    out = final_layernorm(x)          logits = lm_head(out)

as the checkpoint's own modeling code defines it (the hidden state first in the
concatenation; DeepSeek-V3's layers put the embedding first). The block attends over its own
keys and values at positions ``0 .. j``, kept in a one-layer paged cache (the runner's
``mtp_cache``) under the served model's block tables, so it shares the served model's
blocks, reservations and prefix cache. Its rows are one-token rows of the decode path:
keys and values of a pass are stored before any row attends, so rows of one sequence at
consecutive positions see each other as a chunk's would.

:mod:`.mtp_draft` runs it as the draft source of speculative decoding.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from furnace_trio.loading.model_config import MTP_PREFIX, ModelConfig
from furnace_trio.runtime import native, native_forward
from furnace_trio.runtime.decoder_layer import DecoderLayer
from furnace_trio.runtime.kv_cache import KVCache
from furnace_trio.runtime.layers import MLP, RMSNorm, WeightSource
from furnace_trio.runtime.step_inputs import StepInputs

__all__ = ["MTPHead"]


class MTPHead(nn.Module):
    """The first multi-token-prediction layer of a model (``model.mtp_layers.0.*``)."""

    def __init__(self, config: ModelConfig, weights: WeightSource) -> None:
        super().__init__()
        prefix = f"{MTP_PREFIX}0"
        eps = config.rms_norm_eps
        self.eps = eps
        self.token_layernorm = RMSNorm(weights.tensor(f"{prefix}.token_layernorm.weight"), eps)
        self.hidden_layernorm = RMSNorm(weights.tensor(f"{prefix}.hidden_layernorm.weight"), eps)
        self.input_proj = weights.linear("input_proj", [f"{prefix}.input_proj.weight"])
        self.block = DecoderLayer(config, weights, 0, prefix=prefix)
        self.final_layernorm = RMSNorm(weights.tensor(f"{prefix}.final_layernorm.weight"), eps)
        # The block in one native call when its linears are native ones (as the decoder's
        # all-decode steps run): one parallel region for the layer instead of ten.
        self._fused = native_forward.FusedDecode(config)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        inputs: StepInputs,
        kernels: native.Kernels | None,
        *,
        fusable: bool = False,
    ) -> torch.Tensor:
        """The layer's output (``out`` above) at every row: ``hidden`` the decoder's final
        hidden states, ``embeds`` the next tokens' embeddings, ``cos``/``sin`` ``[T, D]``
        at the rows' positions; ``kernels``: the native float32 CPU path, else torch;
        ``fusable``: the block is Llama-shaped (the decoder's fused decode call takes it)."""
        joined = torch.cat((self.hidden_layernorm(hidden), self.token_layernorm(embeds)), dim=-1)
        x = self.input_proj(joined)
        ptrs = None
        if kernels is not None and fusable and len(inputs.decode_rows) == len(inputs.context_lens):
            ptrs = self._fused.layer_ptrs(nn.ModuleList([self.block]), cache, kernels)
        if kernels is not None and ptrs is not None:
            intermediate = cast(MLP, self.block.mlp).intermediate
            self._fused.run(ptrs, intermediate, x, cos, sin, inputs, cache, kernels)
        elif kernels is not None:
            native_forward.run_layers([self.block], x, cos, sin, cache, inputs, kernels, self.eps)
        else:
            c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
            x = self.block(x, c, s, cache.layers[0], inputs)
        return self.final_layernorm(x)
