"""The model's building blocks below attention: where weights come from
(:class:`WeightSource`), the float linear layer, RMSNorm, the rotary embedding's
frequencies and rotation, and the gated MLP.

Projections are fused (q/k/v into one matrix, gate/up into one) so a step makes few, large
matrix products; :class:`Linear` is the single place a quantized kernel plugs in
(:mod:`furnace_trio.runtime.quant`, :mod:`furnace_trio.runtime.blocks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime.embedding import Embedding


class WeightSource(Protocol):
    """Where the model's modules take their weights, by Hugging Face name, each already in
    its runtime form (:class:`~furnace_trio.runtime.build.WeightBuilder`): asked for in
    model order, one at a time, so the source can convert each as it goes."""

    def tensor(self, name: str) -> torch.Tensor: ...

    def linear(self, kind: str, names: Sequence[str], biases: Sequence[str] = ()) -> nn.Module: ...

    def embedding(self) -> Embedding: ...

    def head(self, tied: bool) -> nn.Module: ...

    def unused(self) -> list[str]: ...

    def drop(self, prefix: str) -> None: ...


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
    ops it launches, a layer's two norms at five ops each would be over a quarter of its
    ops. In half precision torch's CPU kernel rounds once, after the weight, where Hugging
    Face's Llama rounds before it too: the two differ by at most one unit in the last place.
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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three ops.

    ``rotate_half(x) = cat(-x2, x1)`` is ``roll(x, half) * [-1.., +1..]``; the sign is folded
    into ``signed_sin`` once per step (:meth:`~furnace_trio.runtime.model.Transformer.forward`).
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, signed_sin)


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
