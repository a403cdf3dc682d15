"""Load a Hugging Face model directory: ``config.json`` + safetensors -> config, weights.

Accepted: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MiMoForCausalLM`` (Qwen2 with multi-token-prediction layers,
``model.mtp_layers.*``, for speculative decoding), ``Gemma3ForCausalLM`` (text-only,
``gemma3_text``), ``Phi3ForCausalLM`` (see :mod:`~furnace_trio.loading.phi3`), and the mixtures of experts
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` (see
:mod:`~furnace_trio.loading.moe`) checkpoints, in one ``model.safetensors`` or sharded through
``model.safetensors.index.json``. Weights come back as records over the memory-mapped
files (:class:`~furnace_trio.loading.tensors.LazyWeights`, float32 when looked up) under
their own (already Hugging Face Llama) names; a tied checkpoint has no ``lm_head.weight``,
like a GGUF without ``output.weight``, so both loaders' outputs are interchangeable. Gemma's
RMSNorm weights are stored as the multiplier minus one; their records add the one back, as
llama.cpp's converter does when it writes a GGUF.

The safetensors header (a little-endian u64 length, then JSON: name -> dtype, shape and
byte range after the header) is read here; ``F32``, ``F16`` and ``BF16`` (and ``F64``) are
GGML's float types byte for byte, so a record needs nothing else to read a tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from furnace_trio.loading.model_config import (
    MTP_PREFIX,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
    gemma3_sliding_layers,
    sliding_all,
)
from furnace_trio.loading.moe import hf_moe, hf_moe_records
from furnace_trio.loading.phi3 import hf_phi3_fields, split_fused
from furnace_trio.loading.tensors import LazyWeights, MappedFile, TensorRecord

__all__ = ["load_hf_directory"]

logger = logging.getLogger(__name__)

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "mimo": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
_CLASS_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MiMoForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# Hugging Face activation names -> ModelConfig.hidden_activation.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_DTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "F64": gguf.GGMLQuantizationType.F64,
}
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def load_hf_directory(path: str | Path) -> tuple[ModelConfig, LazyWeights]:
    """Load ``config.json`` and the safetensors weights of a Hugging Face model directory.

    Raises :class:`FileNotFoundError` naming ``config.json`` or the safetensors file when
    one is missing, and :class:`UnsupportedModelError` naming the architecture when it is
    not of the Llama family. ``lm_head.weight`` is dropped when embeddings are tied (some
    checkpoints store the copy), so the result has one name per distinct tensor.
    """
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not a Hugging Face model directory)")
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{config_path}: not a JSON object")
    config = config_from_hf(raw)
    records: dict[str, TensorRecord] = {}
    for file in _safetensors_files(directory):
        records.update(_safetensors_records(file))
    if config.architecture == "gemma3":
        records = {
            name: dataclasses.replace(r, shift=1.0) if name.endswith("norm.weight") else r
            for name, r in records.items()
        }
    if config.architecture == "phi3":
        records = _split_phi3(records, config)
    if config.moe is not None:
        records = hf_moe_records(records, config.moe)
    if config.mtp_layers and not any(n.startswith(MTP_PREFIX) for n in records):
        logger.info("%s: the config names MTP layers, the weights have none", directory)
        config = dataclasses.replace(config, mtp_layers=0)
    if config.tie_word_embeddings:
        records.pop("lm_head.weight", None)
    elif "lm_head.weight" not in records:
        raise UnsupportedModelError(f"{directory}: untied embeddings but no lm_head.weight")
    return config, LazyWeights(records)


def _split_phi3(records: dict[str, TensorRecord], config: ModelConfig) -> dict[str, TensorRecord]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as Llama's separate projections."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, TensorRecord] = {}
    for name, record in records.items():
        for fused, kind in (
            (".self_attn.qkv_proj.weight", "qkv"),
            (".mlp.gate_up_proj.weight", "gate_up"),
        ):
            if name.endswith(fused):
                prefix = name.removesuffix(fused)
                out.update(split_fused(record, prefix, kind, (q, kv, kv), config.intermediate_size))
                break
        else:
            out[name] = record
    return out


def _safetensors_records(path: Path) -> dict[str, TensorRecord]:
    """One record per tensor of a safetensors file, from its header alone."""
    file = MappedFile(path)
    with path.open("rb") as raw:
        head = raw.read(8)
        if len(head) != 8:
            raise UnsupportedModelError(f"{path}: not a safetensors file (truncated header)")
        (size,) = struct.unpack("<Q", head)
        if size > file.size - 8:
            raise UnsupportedModelError(f"{path}: not a safetensors file (header size)")
        header = json.loads(raw.read(size))
    if not isinstance(header, dict):
        raise UnsupportedModelError(f"{path}: safetensors header is not a JSON object")
    records: dict[str, TensorRecord] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ggml_type = _DTYPES.get(entry["dtype"])
        if ggml_type is None:
            raise UnsupportedModelError(
                f"{path.name}: tensor {name} is {entry['dtype']}; supported: {', '.join(_DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        shape = tuple(int(d) for d in entry["shape"])
        if end - begin != math.prod(shape) * gguf.GGML_QUANT_SIZES[ggml_type][1]:
            raise UnsupportedModelError(f"{path.name}: tensor {name} has the wrong byte count")
        records[name] = TensorRecord(name, shape, ggml_type, file, 8 + size + begin, end - begin)
    return records


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` object to :class:`ModelConfig`.

    The architecture comes from ``model_type``, else from ``architectures``. Qwen2 always
    has a qkv bias and Qwen3 always has q/k norms (their configs do not say so). Rope
    parameters are read from ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5, which also moves ``rope_theta`` in there).
    """
    arch = _architecture(raw)
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    head_dim = raw.get("head_dim") or hidden // num_heads
    extra = _gemma3_fields(raw, rope) if arch == "gemma3" else {}
    if extra:
        rope = rope.get("full_attention", rope)
    if arch == "phi3":
        extra = hf_phi3_fields(raw, rope)
    if arch in ("mixtral", "qwen2moe", "qwen3moe"):
        extra = {"moe": hf_moe(arch, raw)}
    if arch == "mixtral":
        layers = int(raw["num_hidden_layers"])
        context = int(raw.get("max_position_embeddings", 2048))
        extra.update(sliding_all(raw.get("sliding_window"), context, layers))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=arch in ("qwen2", "qwen2moe") or bool(raw.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        rope_scaling=None if arch in ("gemma3", "phi3") else _rope_scaling(rope),
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0) if arch == "qwen2" else 0,
        **extra,
    )


def _gemma3_fields(raw: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` fields particular to a ``gemma3_text`` config.

    Sliding layers come from ``layer_types`` (transformers 5) or ``sliding_window_pattern``
    (every n-th layer global); rope bases from ``rope_parameters`` per layer type, or
    ``rope_theta`` and ``rope_local_base_freq``.
    """
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit softcapping (Gemma 2) is not supported")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported hidden_activation {activation!r}")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    else:
        sliding = gemma3_sliding_layers(layers, int(raw.get("sliding_window_pattern") or 6))
    local = rope.get("sliding_attention", {}) if "full_attention" in rope else {}
    full = rope.get("full_attention", rope)
    full_type = full.get("rope_type") or full.get("type") or "default"
    if full_type not in ("default", "linear"):
        raise UnsupportedModelError(f"unsupported rope scaling {full_type!r} for Gemma 3")
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModelError("rope scaling on sliding-window layers is not supported")
    local_theta = local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
    window = raw.get("sliding_window")
    softcap = raw.get("final_logit_softcapping")
    return {
        "sandwich_norms": True,
        "hidden_activation": _ACTIVATIONS[activation],
        "embedding_multiplier": float(raw["hidden_size"]) ** 0.5,
        "attention_scale": float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding if window else (),
        "rope_local_theta": float(local_theta),
        "rope_linear_factor": float(full["factor"]) if full_type == "linear" else 1.0,
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def _architecture(raw: Mapping[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type is not None:
        if model_type not in _MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}"
            )
        return _MODEL_TYPES[model_type]
    classes = raw.get("architectures") or []
    for name in classes:
        if name in _CLASS_TYPES:
            return _CLASS_TYPES[name]
    raise UnsupportedModelError(
        f"unsupported architectures {classes!r}; supported: {', '.join(_CLASS_TYPES)}"
    )


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r} (only llama3)")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files, in index order for sharded checkpoints; each must exist."""
    index_path = directory / _INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        names = sorted(set(index.get("weight_map", {}).values()))
        if not names:
            raise UnsupportedModelError(f"{index_path}: empty weight_map")
        files = [directory / name for name in names]
    else:
        files = [directory / _SINGLE_FILE]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{directory}: missing {file.name}")
    return files
