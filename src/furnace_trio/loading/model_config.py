"""The architecture description every loader produces and the model runtime consumes.

One frozen record for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and
Gemma 3: the variations are flags (``attention_bias`` for Qwen2's qkv bias, ``qk_norm`` for
Qwen3's and Gemma 3's per-head RMSNorm), an optional llama3 rope scaling, and Gemma 3's
differences (see :class:`ModelConfig`), not subclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
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
