"""The architecture description every loader produces and the model runtime consumes.

One frozen record for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2), Gemma 3,
Phi-3 and the mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the variations
are flags (``attention_bias`` for Qwen2's qkv bias, ``qk_norm`` for Qwen3's and Gemma 3's
per-head RMSNorm), an optional llama3 or LongRoPE rope scaling, Gemma 3's differences and
the experts (see :class:`ModelConfig` and :class:`MoE`), not subclasses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
)
#: Where a checkpoint keeps its multi-token-prediction layers (MiMo's names).
MTP_PREFIX = "model.mtp_layers."
#: Activations of the gated MLP: SiLU (Llama), GELU with the tanh approximation (Gemma).
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh")


class UnsupportedModelError(ValueError):
    """A model file or directory that furnace-trio cannot serve (the message says why)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LongRope:
    """Phi-3's LongRoPE (``rope_type: longrope``, formerly ``su``): one divisor per rotary
    frequency, ``short_factor`` for contexts up to ``original_max_position_embeddings`` and
    ``long_factor`` beyond, and cos/sin multiplied by ``attention_factor``.

    ``long`` says which set is in use. A served context is one size for every sequence
    (the KV cache keeps keys rotated once), so the choice is made per server, as llama.cpp
    makes it per context: long factors when the served context exceeds the original one
    (:func:`fit_context`)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    long: bool = True

    @property
    def factors(self) -> tuple[float, ...]:
        return self.long_factor if self.long else self.short_factor


@dataclass(frozen=True, slots=True)
class MoE:
    """A sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE).

    A router (``mlp.gate``) scores ``num_experts`` experts per token; the ``top_k`` best by
    softmax probability run, their outputs weighted by those probabilities, renormalized
    to sum to one when ``norm_topk_prob`` (Mixtral, Qwen3-MoE; not Qwen2-MoE). Each expert
    is a gated SiLU MLP of ``intermediate_size``. ``shared_intermediate_size`` > 0: a
    shared expert that every token runs (Qwen2-MoE), scaled by ``sigmoid`` of its own
    one-output gate. ``layers``: which layers are sparse (the others keep the dense MLP of
    :attr:`ModelConfig.intermediate_size`); empty means all.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    layers: tuple[bool, ...] = ()

    def sparse(self, layer: int) -> bool:
        return not self.layers or self.layers[layer]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family or Gemma 3 decoder.

    ``architecture`` is one of :data:`SUPPORTED_ARCHITECTURES` (SmolLM2 is ``llama``).
    ``head_dim`` is explicit because Qwen3 decouples it from ``hidden_size // num_heads``.
    RMSNorm weights are always the multiplier itself: Gemma's checkpoints store
    ``w - 1`` and the loaders add the 1 back (as llama.cpp's converter does).

    Gemma 3's differences, each a field with the Llama value as its default:

    - ``sandwich_norms``: four norms per layer, the attention's and the MLP's outputs
      normed too (``post_attention_layernorm`` is then the norm of the attention output,
      ``pre_feedforward_layernorm`` the MLP's input norm).
    - ``hidden_activation``: one of :data:`HIDDEN_ACTIVATIONS`.
    - ``embedding_multiplier``: the embeddings are scaled by it (Gemma: sqrt(hidden)).
    - ``attention_scale``: the scores' scale (``None``: ``1 / sqrt(head_dim)``).
    - ``sliding_window`` and ``sliding_layers``: the layers whose queries see only the
      last ``sliding_window`` positions (their own included); their rotary embedding
      uses ``rope_local_theta`` (``None``: ``rope_theta``), never scaled.
    - ``rope_linear_factor``: linear rope scaling of the global layers (positions divided
      by it; Gemma 3 4B and larger).
    - ``final_logit_softcapping``: logits become ``c * tanh(logits / c)``.

    Phi-3 is Llama's pass with LongRoPE (``longrope``) and, where its window is shorter
    than its context, every layer sliding; its fused ``qkv_proj`` and ``gate_up_proj``
    are split into Llama's names by the loaders. ``moe``: the experts of a
    mixture-of-experts model (:class:`MoE`). ``mtp_layers``: the multi-token-prediction
    layers the file ships beside the decoder (MiMo's ``model.mtp_layers.*``; see
    :mod:`~furnace_trio.runtime.mtp`), which only speculative decoding runs.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sandwich_norms: bool = False
    hidden_activation: str = "silu"
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    rope_linear_factor: float = 1.0
    final_logit_softcapping: float | None = None
    longrope: LongRope | None = None
    moe: MoE | None = None
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported activation {self.hidden_activation!r}; "
                f"supported: {', '.join(HIDDEN_ACTIVATIONS)}"
            )
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.sliding_layers)} sliding-window flags for {self.num_layers} layers"
            )
        if any(self.sliding_layers) and (self.sliding_window is None or self.sliding_window < 1):
            raise UnsupportedModelError("sliding-window layers without a positive window")
        if self.longrope is not None:
            half = self.head_dim // 2
            if len(self.longrope.short_factor) != half or len(self.longrope.long_factor) != half:
                raise UnsupportedModelError(
                    f"LongRoPE needs {half} factors per set (head_dim / 2), got "
                    f"{len(self.longrope.short_factor)} and {len(self.longrope.long_factor)}"
                )
        moe = self.moe
        if moe is not None:
            if not 0 < moe.top_k <= moe.num_experts:
                raise UnsupportedModelError(
                    f"{moe.top_k} experts per token out of {moe.num_experts}"
                )
            if moe.layers and len(moe.layers) != self.num_layers:
                raise UnsupportedModelError(
                    f"{len(moe.layers)} sparse-layer flags for {self.num_layers} layers"
                )

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is a mixture of experts."""
        return self.moe is not None and self.moe.sparse(layer)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (``None``: it sees the whole context)."""
        if self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        if self.attention_scale is not None:
            return self.attention_scale
        return 1.0 / math.sqrt(self.head_dim)


def gemma3_sliding_layers(num_layers: int, pattern: int) -> tuple[bool, ...]:
    """Which layers slide in Gemma 3's pattern: every ``pattern``-th layer (the last of
    each group, as llama.cpp's ``set_swa_pattern``) sees everything, the others slide."""
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers))


def fit_context(config: ModelConfig, context: int) -> ModelConfig:
    """``config`` as served with a context of ``context`` tokens: LongRoPE's long factors
    when it exceeds the original context, else the short ones (see :class:`LongRope`)."""
    rope = config.longrope
    if rope is None:
        return config
    long = context > rope.original_max_position_embeddings
    return dataclasses.replace(config, longrope=dataclasses.replace(rope, long=long))


def sliding_all(window: int | None, context: int, num_layers: int) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a model whose every layer slides with ``window``
    (Phi-3, Mistral-style configs), as transformers applies it; none when there is no
    window or it covers the whole context."""
    if not window or window >= context:
        return {}
    return {"sliding_window": int(window), "sliding_layers": (True,) * num_layers}
