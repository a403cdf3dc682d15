"""Int8 linear layers for the CPU.

Decode on a CPU is memory bound: a step reads every weight once, so int8 weights (a quarter
of float32's bytes) are the main lever. Two implementations:

- :class:`NativeInt8Linear` (the default where a C compiler is available): weight-only int8,
  float32 activations, with the kernel of ``cpu_kernels.c`` (:mod:`furnace_trio.native`).
  Each int8 weight vector is widened to float in registers and multiplied with float
  activations, so only weights are quantized (no activation rounding at all) and every
  output row depends on its input row alone, in the same arithmetic order whatever the
  batch: decode rows are bitwise batch invariant. Prefill uses the same kernel (torch's
  BLAS on a widened copy of the weight was measured about 10% faster on 512-token chunks,
  but would make a row's numerics depend on how many rows share its step).
- :class:`Int8Linear`, the fallback without a compiler: int8 weights *and* int8 activations,
  exact int32 accumulation, with fbgemm's kernel (the one behind torch's dynamic quantized
  linear), described below.

Why per-row activation scales, and how
--------------------------------------
fbgemm's dynamic linear picks one activation scale per *input tensor*, from its min and max.
In a server the input tensor is the whole batch, so one request's quantization (and thus its
greedy output) would depend on which other requests share the step. Here every row is
divided by its own absolute maximum first, so each row spans at most ``[-1, 1]``, and the
kernel is called with *fixed* quantization parameters (``scale = 1/63.5``, zero point 64).
A row's uint8 codes therefore depend on that row alone; the int32 accumulation is exact and
the float epilogue is elementwise, so a row's output is bitwise the same alone or in any
batch (``tests/test_quant.py`` checks this). The row's maximum is multiplied back at the end.

Seven bits per activation lose too much on SmolLM2 (perplexity +15% over float32: its
residual stream has outlier channels), so each row is sent through the kernel twice in
one call: the row itself, and its rounding residual scaled back up to ``[-1, 1]``. The
two products add up to an activation precision of about 14 bits (perplexity within about
1% of float32), while the weight, the bytes that bound decode, is still read once: the
kernel sees ``2M`` rows instead of ``M``, which costs little at decode batch sizes.

Activations use 7 bits (codes 0..127) on purpose: fbgemm's AVX2 path sums pairs of
uint8 x int8 products in int16 (``vpmaddubsw``), which saturates with full 8-bit codes; this
is the same reason torch's own dynamic quantization defaults to ``reduce_range`` on x86.

Weights are quantized symmetrically per output channel (``[-127, 127]``, one scale per row
of ``W``), which keeps the pair sums above in range.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Literal

import torch
from torch import nn

from . import native

logger = logging.getLogger(__name__)

Quantization = Literal["auto", "none", "int8"]
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8")


def resolve_quantization(name: str, device: torch.device) -> Literal["none", "int8"]:
    """``auto`` is int8 on the CPU when fbgemm is available (measured faster), else none."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {name!r}; choose one of {QUANTIZATIONS}")
    if name == "auto":
        cpu = device.type == "cpu"
        return "int8" if cpu and "fbgemm" in torch.backends.quantized.supported_engines else "none"
    return "int8" if name == "int8" else "none"


# Fixed activation quantization: [-1, 1] -> codes [0.5, 127.5] -> rounded, within 0..128.
_ACT_LEVELS = 63.5
_ACT_SCALE = 1.0 / _ACT_LEVELS
# The residual row carries (codes - round(codes)) * 2 / _ACT_LEVELS, scaled up by 2 * 63.5.
_RESIDUAL_WEIGHT = 1.0 / (2.0 * _ACT_LEVELS)
_ACT_ZERO_POINT = 64
# Rows that are entirely zero keep a tiny divisor instead of dividing by zero.
_MIN_ROW_MAX = 1e-12


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ~= q * scale[:, None]``, ``q`` in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class NativeInt8Linear(nn.Module):
    """``y = x @ (q * scale).T (+ b)``: int8 weights, float32 activations (CPU, native kernel).

    Same call signature as :class:`furnace_trio.model.Linear`. The weight is kept only in
    the kernel's packed layout (:meth:`~furnace_trio.native.Kernels.pack_w8`).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.Kernels
    ) -> None:
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = weight.shape
        self.packed = kernels.pack_w8(q)
        self.scale = scale.float().contiguous()
        self.bias: torch.Tensor | None = (
            None if bias is None else bias.detach().float().contiguous()
        )
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        self._kernels.w8_linear(x2, self.packed, self.scale, self.bias, y)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (native)"


class Int8Linear(nn.Module):
    """``y ~= x @ W.T (+ b)`` with ``W`` in int8 and per-row int8 activations (CPU only).

    Keeps the call signature of :class:`furnace_trio.model.Linear`: float32 ``[..., in]`` in,
    float32 ``[..., out]`` out. Each output row depends only on the matching input row.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError("int8 linear layers run on the CPU only (fbgemm)")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("this torch build has no fbgemm quantized engine")
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = weight.shape
        with warnings.catch_warnings():
            # torch 2.13 deprecates quantized tensor *creation*; the prepacked weight is all
            # that is kept, and the fbgemm kernel itself is not deprecated.
            warnings.filterwarnings("ignore", ".*quantized tensor creation", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros_like(scale, dtype=torch.int64), 0
            )
        # The bias is added after the row maximum is multiplied back, so it is not packed.
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias: torch.Tensor | None = (
            None if bias is None else bias.detach().float().contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        row_max = torch.linalg.vector_norm(x2, math.inf, dim=1, keepdim=True)
        row_max = row_max.clamp_min_(_MIN_ROW_MAX)
        rows = x2.shape[0]
        # Both halves of the kernel's input are written in place into one buffer.
        both = torch.empty((2 * rows, self.in_features), dtype=torch.float32)
        normed, residual = both[:rows], both[rows:]
        torch.div(x2, row_max, out=normed)
        torch.mul(normed, _ACT_LEVELS, out=residual)
        # What 7-bit rounding loses, in [-0.5, 0.5] codes, stretched to [-1, 1].
        residual.sub_(torch.round(residual)).mul_(2.0)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            both, _ACT_SCALE, _ACT_ZERO_POINT, self._packed
        )
        y = y[:rows].add_(y[rows:], alpha=_RESIDUAL_WEIGHT).mul_(row_max)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(
    module: nn.Module, linear_type: type[nn.Module], kernels: native.Kernels | None = None
) -> int:
    """Replace every ``linear_type`` submodule (with ``.weight``/``.bias``) by an int8 one:
    :class:`NativeInt8Linear` with ``kernels``, else the fbgemm :class:`Int8Linear`.

    Returns how many were replaced. Float weights are dropped as their module is replaced
    (a tied ``lm_head`` keeps the embedding table alive, which the embedding lookup needs).
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, linear_type):
            weight = child.weight
            bias = getattr(child, "bias", None)
            if not isinstance(weight, torch.Tensor):
                raise TypeError(f"{name}.weight is not a tensor")
            b = None if bias is None else bias.data
            layer = (
                Int8Linear(weight.data, b)
                if kernels is None
                else NativeInt8Linear(weight.data, b, kernels)
            )
            setattr(module, name, layer)
            count += 1
        else:
            count += quantize_linears(child, linear_type, kernels)
    return count
