"""Quantized linear layers for the CPU: 4-bit and int8.

Decode on a CPU is memory bound: a step reads every weight once, so fewer bytes per weight
are the main lever. Three implementations:

- :class:`NativeQ4Linear` and :class:`NativeQ8Linear` (what ``auto`` runs where the
  weights already are Q4_1 or Q8_0 values, as all of the default model's are; ``q4``
  forces them): llama.cpp's Q4_1 weights (per output and group of 32 inputs, ``d * q + m``
  with 4-bit codes, float16 ``d`` and ``m``: 0.625 bytes per weight) and Q8_0 weights
  (``d * q``, signed 8-bit codes: 1.0625 bytes), for such a file exactly its weights,
  against activations rounded per row and group of 32 to int8 (scale ``max|x| / 127``,
  Q8_0's rule), multiplied with integer dot products (VNNI where the CPU has it). The
  rounding of a row depends on that row alone and integer sums are exact, so rows stay
  bitwise batch invariant. Perplexity on the default model: +0.56% over float32
  (``tests/test_quant.py``, ``benchmarks/bench_quality.py``).
- :class:`NativeInt8Linear` (``int8``, and any weight ``auto`` finds on neither grid): weight-only int8,
  float32 activations, with the kernel of ``cpu_kernels.c`` (:mod:`furnace_trio.runtime.native`).
  Each int8 weight vector is widened to float in registers and multiplied with float
  activations, so only weights are quantized (no activation rounding at all) and every
  output row depends on its input row alone, in the same arithmetic order whatever the
  batch: decode rows are bitwise batch invariant. Prefill uses the same kernel (torch's
  BLAS on a widened copy of the weight is a little faster on long chunks, docs/history.md,
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
from typing import Literal, cast

import torch
from torch import nn

from furnace_trio.runtime import native

logger = logging.getLogger(__name__)

Quantization = Literal["auto", "none", "int8", "q4"]
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8", "q4")
# Which linear layers get Q4_1 / Q8_0 groups (the rest int8): none, those whose weights are
# already on one of those grids (lossless: a GGUF's), or all (Q4_1, the LM head Q8_0).
FourBit = Literal["never", "lossless", "always"]


def resolve_quantization(name: str, device: torch.device) -> Literal["none", "int8", "q4", "auto"]:
    """``auto`` stays ``auto`` on the CPU when fbgemm is available (Q4_1 / Q8_0 where that is
    lossless, int8 elsewhere; see :func:`quantize_linears`), else it is none."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {name!r}; choose one of {QUANTIZATIONS}")
    if name == "auto":
        cpu = device.type == "cpu"
        return "auto" if cpu and "fbgemm" in torch.backends.quantized.supported_engines else "none"
    return cast(Literal["none", "int8", "q4"], name)


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


Q4_GROUP = 32


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes, scales and minimums in Q4_1's scheme: per output and group of
    :data:`Q4_GROUP` inputs, ``d = (max - min) / 15``, ``m = min`` (both float16) and
    ``w ~= d * q + m`` with ``q`` in 0..15. Weights dequantized from a Q4_1 GGUF come back
    exactly (:func:`dequantize_q4` gives the same float32 values).
    Returns ``q`` ``[N, K]`` uint8, ``d`` and ``m`` ``[N, K / 32]`` float16."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    d = ((high - low) / 15.0).half()
    m = low.half()
    step = d.float().masked_fill(d == 0, 1.0)
    q = torch.round((groups - m.float()[..., None]) / step[..., None]).clamp_(0, 15)
    return q.reshape(n, k).to(torch.uint8), d, m


def dequantize_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``d * q + m`` in float32, as the kernel (and a GGUF reader) computes each weight."""
    n, k = q.shape
    groups = q.reshape(n, k // Q4_GROUP, Q4_GROUP).float()
    return (groups * d.float()[..., None] + m.float()[..., None]).reshape(n, k)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0: per output and group of :data:`Q4_GROUP` inputs, ``d = max|w| / 127`` (float16)
    and ``q = round(w / d)`` in -127..127. Weights dequantized from a Q8_0 GGUF come back
    exactly. Returns ``q`` ``[N, K]`` int8 and ``d`` ``[N, K / 32]`` float16."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // Q4_GROUP, Q4_GROUP)
    d = (groups.abs().amax(dim=2) / 127.0).half()
    step = d.float().masked_fill(d == 0, 1.0)
    q = torch.round(groups / step[..., None]).clamp_(-127, 127)
    return q.reshape(n, k).to(torch.int8), d


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.reshape(n, k // Q4_GROUP, Q4_GROUP).float() * d.float()[..., None]).reshape(n, k)


class NativeLinear(nn.Module):
    """What the native layers share: the float32 ``[..., in]`` -> ``[..., out]`` call of
    :class:`furnace_trio.runtime.layers.Linear`, over a packed weight the subclass multiplies in
    :meth:`_multiply`, and the layer's entry in ``furnace_decode_layers``' table."""

    label = ""
    #: What :func:`quantize_linears` counts the layer as.
    counts_as = ""
    #: The layer's kind in ``furnace_decode_layers``' table (``native.LINEAR_*``).
    table_kind = -1

    def __init__(
        self, shape: tuple[int, int], bias: torch.Tensor | None, kernels: native.Kernels
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.bias: torch.Tensor | None = (
            None if bias is None else bias.detach().float().contiguous()
        )
        self._kernels = kernels
        self.packed = torch.empty(0, dtype=torch.uint8)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def table_row(self) -> list[int]:
        """Kind, packed weight, scale (0 where the packing holds its scales) and bias
        addresses: this linear's entries in ``furnace_decode_layers``' table."""
        bias = 0 if self.bias is None else self.bias.data_ptr()
        return [self.table_kind, self.packed.data_ptr(), 0, bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        self._multiply(x2, y)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.label}"


class _GroupedLinear(NativeLinear):
    """Weights in groups of :data:`Q4_GROUP` inputs (Q4_1 or Q8_0, ``bits``) against
    activations rounded per row and group to int8 in the kernel. ``codes``: the
    subclass's ``quantize(weight)`` when the caller has it already."""

    bits = 0

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: native.Kernels,
        codes: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        super().__init__((weight.shape[0], weight.shape[1]), bias, kernels)
        codes = self.quantize(weight) if codes is None else codes
        self.packed = kernels.pack_q4(*codes) if self.bits == 4 else kernels.pack_q8(*codes)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._kernels.grouped_linear(self.bits, x, self.packed, self.bias, out)


class NativeQ4Linear(_GroupedLinear):
    """``y = x @ W.T (+ b)`` with ``W`` in 4-bit groups (:func:`quantize_q4`) and the
    activations rounded per row and group to int8 in the kernel (CPU, native kernel)."""

    label = "4-bit (native)"
    counts_as = "q4"
    table_kind = native.LINEAR_Q4
    bits = 4
    quantize = staticmethod(quantize_q4)


class NativeQ8Linear(_GroupedLinear):
    """``y = x @ W.T (+ b)`` with ``W`` in Q8_0 groups (:func:`quantize_q8`) and the
    activations rounded like :class:`NativeQ4Linear`'s (CPU, native kernel)."""

    label = "Q8_0 (native)"
    counts_as = "q8"
    table_kind = native.LINEAR_Q8
    bits = 8
    quantize = staticmethod(quantize_q8)


class NativeInt8Linear(NativeLinear):
    """``y = x @ (q * scale).T (+ b)``: int8 weights, float32 activations (CPU, native kernel).

    The weight is kept only in the kernel's packed layout
    (:meth:`~furnace_trio.runtime.native.Kernels.pack_w8`).
    """

    label = "int8 (native)"
    counts_as = "int8"
    table_kind = native.LINEAR_W8

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.Kernels
    ) -> None:
        super().__init__((weight.shape[0], weight.shape[1]), bias, kernels)
        q, scale = quantize_weight(weight)
        self.packed = kernels.pack_w8(q)
        self.scale = scale.float().contiguous()

    def table_row(self) -> list[int]:
        row = super().table_row()
        row[2] = self.scale.data_ptr()
        return row

    def _multiply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._kernels.w8_linear(x, self.packed, self.scale, self.bias, out)


class Int8Linear(nn.Module):
    """``y ~= x @ W.T (+ b)`` with ``W`` in int8 and per-row int8 activations (CPU only).

    Keeps the call signature of :class:`furnace_trio.runtime.layers.Linear`: float32
    ``[..., in]`` in, float32 ``[..., out]`` out. Each output row depends only on the matching input row.
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


def _quantized(
    name: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernels: native.Kernels | None,
    four_bit: FourBit,
) -> nn.Module:
    if kernels is None:
        return Int8Linear(weight, bias)
    if four_bit == "never" or weight.shape[1] % Q4_GROUP:
        return NativeInt8Linear(weight, bias, kernels)
    if four_bit == "always":
        if name == "lm_head":
            return NativeQ8Linear(weight, bias, kernels)
        return NativeQ4Linear(weight, bias, kernels)
    codes = quantize_q4(weight)
    if torch.equal(dequantize_q4(*codes), weight.float()):
        return NativeQ4Linear(weight, bias, kernels, codes)
    codes8 = quantize_q8(weight)
    if torch.equal(dequantize_q8(*codes8), weight.float()):
        return NativeQ8Linear(weight, bias, kernels, codes8)
    return NativeInt8Linear(weight, bias, kernels)


def quantize_linears(
    module: nn.Module,
    linear_type: type[nn.Module],
    kernels: native.Kernels | None = None,
    four_bit: FourBit = "never",
) -> dict[str, int]:
    """Replace every ``linear_type`` submodule (with ``.weight``/``.bias``) by a quantized one.

    With ``kernels`` and ``four_bit`` ``lossless`` (what ``auto`` asks): :class:`NativeQ4Linear`
    where :func:`quantize_q4` gives back exactly the float weights (a Q4_1 GGUF's), else
    :class:`NativeQ8Linear` where :func:`quantize_q8` does (a Q8_0 GGUF's), else
    :class:`NativeInt8Linear`: the file's own weights wherever they are Q4_1 or Q8_0.
    ``always``: 4-bit for every layer whose input size divides into groups of 32, except
    ``lm_head`` (4 bits cost its logits too much), which gets Q8_0. ``never``: int8
    everywhere. Without ``kernels``: the fbgemm :class:`Int8Linear` everywhere.

    Returns how many linears there are of each kind (``{"q4": .., "q8": .., "int8": ..}``,
    and a :class:`NativeLinear`'s ``counts_as`` for those the loader built already, such as
    ``"q4_k"``: :func:`furnace_trio.runtime.blocks.linear_from_blocks`). Float weights
    are dropped as their module is replaced (a tied ``lm_head`` keeps the embedding table
    alive, which the embedding lookup needs).
    """
    counts = {"q4": 0, "q8": 0, "int8": 0}
    for name, child in list(module.named_children()):
        if isinstance(child, NativeLinear):
            counts[child.counts_as] = counts.get(child.counts_as, 0) + 1
        elif isinstance(child, linear_type):
            weight = child.weight
            bias = getattr(child, "bias", None)
            if not isinstance(weight, torch.Tensor):
                raise TypeError(f"{name}.weight is not a tensor")
            b = None if bias is None else bias.data
            layer = _quantized(name, weight.data, b, kernels, four_bit)
            counts[layer.counts_as if isinstance(layer, NativeLinear) else "int8"] += 1
            setattr(module, name, layer)
        else:
            for kind, n in quantize_linears(child, linear_type, kernels, four_bit).items():
                counts[kind] = counts.get(kind, 0) + n
    return counts
