"""Load a GGUF file: metadata -> :class:`ModelConfig`, tensors -> records under HF Llama names.

The header is parsed by :mod:`furnace_trio.loading.gguf_file` (fast, torch-free, shared with the
tokenizer); the tensors are not read here: each becomes a
:class:`~furnace_trio.loading.tensors.TensorRecord` over the memory-mapped file, read (as
its blocks, or dequantized by ``gguf.quants.dequantize``, so every quant type it knows is
supported) when the runtime builds that weight.

llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` (and their biases) for the
``llama`` architecture, to turn Hugging Face's "rotate half" RoPE layout into GGML's
interleaved one; the records of those tensors undo it on every read, so the weights are
interchangeable with :func:`furnace_trio.loading.hf_loader.load_hf_directory`'s (Mixtral's
GGUF is a ``llama`` one with experts). Qwen2/Qwen3 (and their MoE), Phi-3 and Gemma 3 GGUFs
are not permuted. Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and up) and the experts
stacked per layer are split into records under the runtime's names
(:mod:`~furnace_trio.loading.phi3`, :mod:`~furnace_trio.loading.moe`). Gemma 3's converter writes its RMSNorm weights with the
one added (the multiplier itself), which is the convention of every loader's output.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from furnace_trio.loading.gguf_file import GGUFContents, GGUFTensorInfo, read_gguf
from furnace_trio.loading.model_config import (
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
    gemma3_sliding_layers,
)
from furnace_trio.loading.moe import gguf_moe, gguf_moe_records, moe_weight_names
from furnace_trio.loading.phi3 import gguf_phi3_fields, split_fused
from furnace_trio.loading.tensors import LazyWeights, MappedFile, TensorRecord, to_float

__all__ = ["GGUFContents", "GGUFTensorInfo", "load_gguf", "read_gguf"]

logger = logging.getLogger(__name__)

# GGUF architecture name -> ModelConfig.architecture (Mistral GGUFs say "llama").
_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
}
# Rope tensors that become config (LongRoPE's factor sets, llama3's divisors), not weights.
_ROPE_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)
# Architectures whose converter permutes Q/K rows (llama.cpp ``LlamaModel.permute``).
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})
# llama.cpp's default when a llama3 GGUF stores rope_freqs without the original context.
_LLAMA3_ORIGINAL_CONTEXT = 8192

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per layer: ``ffn_norm`` is the MLP's input norm, as in Llama, but
# Hugging Face calls it ``pre_feedforward_layernorm`` there (``post_attention_layernorm``
# normalizes the attention's output).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 3's defaults where its GGUF metadata says nothing (llama.cpp's gemma3 loader).
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def load_gguf(path: str | Path) -> tuple[ModelConfig, LazyWeights]:
    """Load a Llama-family GGUF as a config and its weights under Hugging Face names.

    The weights are records over the memory-mapped file (nothing is read but the header
    and ``rope_freqs``); looked up as a mapping, each is a float32 tensor (any type
    ``gguf.quants.dequantize`` supports). Q/K permutation is undone for ``llama`` files. A
    ``rope_freqs.weight`` tensor (llama3 GGUFs) is turned into :class:`RopeScaling`, not
    returned as a weight. Raises :class:`UnsupportedModelError` for other architectures or
    unknown tensors.
    """
    contents = read_gguf(path)
    by_name = {info.name: info for info in contents.tensors}
    file = MappedFile(contents.path)
    config = _config_from_metadata(contents, by_name, file)
    gguf_arch = str(contents.metadata["general.architecture"])
    permuted = gguf_arch in _PERMUTED_ARCHITECTURES
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    records: dict[str, TensorRecord] = {}
    for info in contents.tensors:
        if info.name in _ROPE_TENSORS:
            continue
        split = _split_record(info, file, config)
        if split is not None:
            records.update(split)
            continue
        hf_name = _hf_name(
            info.name, _GEMMA3_BLOCK_NAMES if config.sandwich_norms else _BLOCK_NAMES
        )
        projection = hf_name.rsplit(".", 2)[-2]
        n_head = heads.get(projection) if permuted else None
        records[hf_name] = TensorRecord(
            hf_name, info.shape, info.qtype, file, info.offset, info.n_bytes, n_head
        )
    weights = LazyWeights(records)
    _check_complete(weights, config, contents.path)
    return config, weights


def _split_record(
    info: GGUFTensorInfo, file: MappedFile, config: ModelConfig
) -> dict[str, TensorRecord] | None:
    """The records of a tensor that is several of the runtime's (Phi-3's fused projections,
    stacked experts) or named for the experts; ``None`` for any other tensor."""
    parts = info.name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    record = TensorRecord(info.name, info.shape, info.qtype, file, info.offset, info.n_bytes)
    prefix = f"model.layers.{parts[1]}"
    if config.architecture == "phi3" and parts[2] in ("attn_qkv", "ffn_up"):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        kind = "qkv" if parts[2] == "attn_qkv" else "gate_up"
        return split_fused(record, prefix, kind, (q, kv, kv), config.intermediate_size)
    return gguf_moe_records(parts[1], parts[2], record, config.moe)


def _dequantize(data: np.ndarray | MappedFile, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor to a fresh, writable float32 array of ``info.shape``."""
    if isinstance(data, MappedFile):
        raw = data.read(info.offset, info.n_bytes)
    else:
        raw = data[info.offset : info.offset + info.n_bytes]
    return to_float(raw, info.qtype, info.shape, info.name)


def _hf_name(name: str, block_names: Mapping[str, str]) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in block_names
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected tensor {name!r} in a GGUF")


def _config_from_metadata(
    contents: GGUFContents, by_name: Mapping[str, GGUFTensorInfo], data: MappedFile
) -> ModelConfig:
    meta = contents.metadata
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{contents.path.name}: unsupported architecture {gguf_arch!r}; "
            f"supported: {', '.join(sorted(_ARCHITECTURES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"{contents.path.name}: missing {gguf_arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    embed = by_name.get("token_embd.weight")
    if embed is None:
        raise UnsupportedModelError(f"{contents.path.name}: no token_embd.weight tensor")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else int(meta.get(f"{gguf_arch}.vocab_size", embed.shape[0]))
    if vocab_size != embed.shape[0]:
        # The embedding is what the forward pass indexes; a padded table wins.
        logger.warning(
            "%s: %d tokens but %d embedding rows; using the latter",
            contents.path.name,
            vocab_size,
            embed.shape[0],
        )
        vocab_size = embed.shape[0]
    layers = int(get("block_count"))
    context = int(get("context_length"))
    extra: dict[str, Any] = {}
    if gguf_arch == "gemma3":
        extra = _gemma3_fields(contents, hidden, num_heads)
    elif gguf_arch == "phi3":
        rope = {
            name: TensorRecord(
                name,
                by_name[name].shape,
                by_name[name].qtype,
                data,
                by_name[name].offset,
                by_name[name].n_bytes,
            )
            for name in ("rope_factors_long.weight", "rope_factors_short.weight")
            if name in by_name
        }
        extra = gguf_phi3_fields(meta, rope, layers, context)
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in by_name for i in range(layers)]
    moe = gguf_moe(meta, gguf_arch, layers, sparse, int(get("feed_forward_length")))
    if moe is not None:
        extra["moe"] = moe
    architecture = _ARCHITECTURES[gguf_arch]
    if gguf_arch == "llama" and moe is not None:
        architecture = "mixtral"
    head_count_kv = get("attention.head_count_kv", num_heads)
    if isinstance(head_count_kv, list):  # per-layer lists exist in some GGUFs
        if len(set(head_count_kv)) != 1:
            raise UnsupportedModelError(f"{contents.path.name}: per-layer kv head counts")
        head_count_kv = head_count_kv[0]
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(head_count_kv),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        qk_norm="blk.0.attn_q_norm.weight" in by_name,
        rope_scaling=None
        if gguf_arch in ("gemma3", "phi3")
        else _rope_scaling(contents, by_name, data),
        **extra,
    )


def _gemma3_fields(contents: GGUFContents, hidden: int, num_heads: int) -> dict[str, Any]:
    """Gemma 3's :class:`ModelConfig` fields from GGUF metadata, read as llama.cpp does.

    The sliding pattern is ``attention.sliding_window_pattern`` (a period, or one flag per
    layer), else every 6th layer global; the local rope base ``rope.freq_base_swa``, else
    10,000. The converter does not store ``query_pre_attn_scalar``: llama.cpp scales by
    ``1 / sqrt(head_dim)``, except for the 27B (62 layers), whose scalar is
    ``hidden / heads``. Linear rope scaling (4B and larger) applies to the global layers.
    """
    meta = contents.metadata
    layers = int(meta["gemma3.block_count"])
    head_dim = int(meta.get("gemma3.attention.key_length", hidden // num_heads))
    window = meta.get("gemma3.attention.sliding_window")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(f"{contents.path.name}: sliding pattern per layer")
        sliding = tuple(bool(flag) for flag in pattern)
    else:
        sliding = gemma3_sliding_layers(layers, int(pattern))
    scalar = hidden // num_heads if layers == _GEMMA3_27B_LAYERS else head_dim
    softcap = meta.get("gemma3.final_logit_softcapping")
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{contents.path.name}: rope scaling {scaling!r}")
    factor = float(meta.get("gemma3.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    return {
        "sandwich_norms": True,
        "hidden_activation": "gelu_tanh",
        "embedding_multiplier": math.sqrt(hidden),
        "attention_scale": float(scalar) ** -0.5,  # as transformers computes it
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding if window else (),
        "rope_local_theta": float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        "final_logit_softcapping": float(softcap) if softcap else None,
        "rope_linear_factor": factor,
    }


def _rope_scaling(
    contents: GGUFContents, by_name: Mapping[str, GGUFTensorInfo], data: MappedFile
) -> RopeScaling | None:
    """Llama3 rope scaling from metadata, else recovered from a ``rope_freqs`` tensor.

    llama.cpp's converter stores llama3 scaling as one divisor per frequency
    (``rope_freqs.weight``), not as parameters. The divisors are 1 for high frequencies,
    ``factor`` for low ones, and ``1 / ((1 - s) / factor + s)`` in between, with
    ``s = (orig_ctx * freq / 2pi - low) / (high - low)`` linear in ``freq``. ``factor`` is
    the largest divisor; ``orig_ctx`` comes from metadata or llama.cpp's 8192; ``low`` and
    ``high`` are fitted from the middle band, and the result must reproduce the tensor.
    """
    meta = contents.metadata
    arch = meta["general.architecture"]
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    info = by_name.get("rope_freqs.weight")
    if scaling_type in (None, "none") and info is None:
        return None
    if scaling_type not in (None, "none", "llama3"):
        raise UnsupportedModelError(f"{contents.path.name}: rope scaling {scaling_type!r}")
    orig_ctx = int(
        meta.get(f"{arch}.rope.scaling.original_context_length", _LLAMA3_ORIGINAL_CONTEXT)
    )
    if info is None:
        # Only a type and factor in metadata: llama3's published band edges.
        return RopeScaling(float(meta[f"{arch}.rope.scaling.factor"]), 1.0, 4.0, orig_ctx)
    divisors = _dequantize(data, info).astype(np.float64).reshape(-1)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * divisors.size
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    middle = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0
    if middle.sum() >= 2:
        smooth = (1.0 / divisors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(freqs[middle], smooth, 1)
        span = orig_ctx / (2 * math.pi * slope)
        low, high = float(-intercept * span), float(-intercept * span + span)
    scaling = RopeScaling(factor, low, high, orig_ctx)
    if not np.allclose(_llama3_divisors(freqs, scaling), divisors, rtol=1e-4):
        raise UnsupportedModelError(
            f"{contents.path.name}: rope_freqs.weight is not llama3 scaling with an original "
            f"context of {orig_ctx}"
        )
    return scaling


def _llama3_divisors(freqs: np.ndarray, s: RopeScaling) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for llama3 scaling."""
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    middle = 1.0 / ((1 - smooth) / s.factor + smooth)
    high_edge = s.original_max_position_embeddings / s.high_freq_factor
    low_edge = s.original_max_position_embeddings / s.low_freq_factor
    return np.where(wavelen < high_edge, 1.0, np.where(wavelen > low_edge, s.factor, middle))


def _check_complete(weights: Mapping[str, Any], config: ModelConfig, path: Path) -> None:
    """Every tensor the forward pass needs is present (fail at load, not mid-request)."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(config.num_layers):
        attention = ("self_attn.o_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        for part in (*norms, *attention):
            needed.append(f"model.layers.{i}.{part}.weight")
        if config.moe is not None and config.sparse(i):
            needed += moe_weight_names(f"model.layers.{i}", config.moe)
        else:
            needed += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    missing = [name for name in needed if name not in weights]
    if missing:
        raise UnsupportedModelError(f"{path.name}: missing tensors {missing[:5]}")
