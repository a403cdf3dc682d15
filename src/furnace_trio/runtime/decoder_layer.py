"""One decoder layer: attention and the MLP, each behind its norm, on the residual stream."""

from __future__ import annotations

import torch
from torch import nn

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime.attention import Attention
from furnace_trio.runtime.kv_cache import LayerKV
from furnace_trio.runtime.layers import MLP, RMSNorm, WeightSource
from furnace_trio.runtime.moe import SparseMoE
from furnace_trio.runtime.step_inputs import StepInputs


class DecoderLayer(nn.Module):
    """One layer. Llama: ``x += attn(norm(x)); x += mlp(norm2(x))``, where
    ``post_attention_layernorm`` is the MLP's input norm. With ``sandwich_norms`` (Gemma 3)
    the outputs are normed too: ``x += norm2(attn(norm(x))); x += norm4(mlp(norm3(x)))``,
    ``post_attention_layernorm`` being ``norm2``."""

    def __init__(
        self, config: ModelConfig, weights: WeightSource, i: int, prefix: str | None = None
    ) -> None:
        """Layer ``i`` of the decoder, or with ``prefix`` a dense, full-attention layer
        whose weights are named under it (a multi-token-prediction block)."""
        super().__init__()
        window = config.window(i) if prefix is None else None
        sparse = config.sparse(i) if prefix is None else False
        prefix = prefix or f"model.layers.{i}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = Attention(config, weights, prefix, window)
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
            SparseMoE(config, weights, prefix) if sparse else MLP(config, weights, prefix)
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
