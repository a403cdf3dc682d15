"""The architecture description every loader produces and the model runtime consumes.

One frozen record for the whole Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2):
the variations are flags (``attention_bias`` for Qwen2's qkv bias, ``qk_norm`` for Qwen3's
per-head RMSNorm) and an optional llama3 rope scaling, not subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
    """Shapes and numerics of a Llama-family decoder.

    ``architecture`` is one of :data:`SUPPORTED_ARCHITECTURES` (SmolLM2 is ``llama``).
    ``head_dim`` is explicit because Qwen3 decouples it from ``hidden_size // num_heads``.
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
