"""Phi-3 checkpoints (``Phi3ForCausalLM``; llama.cpp's ``phi3``): config and tensor names.

Phi-3 is a Llama decoder whose checkpoints fuse two pairs of projections:
``self_attn.qkv_proj`` (q, k and v rows stacked) and ``mlp.gate_up_proj`` (gate rows, then
up rows); llama.cpp keeps them fused as ``attn_qkv`` and ``ffn_up``. Each part is a run of
whole rows, so it becomes a record of its own under Llama's names
(:meth:`~furnace_trio.loading.tensors.TensorRecord.rows_at`), and the runtime fuses them
again as it does for every model.

Rope: the default, or LongRoPE (``longrope``, formerly ``su``: Phi-3-mini-128k,
Phi-3.5), as :class:`~furnace_trio.loading.model_config.LongRope`; in a GGUF its factor sets
are the ``rope_factors_long``/``rope_factors_short`` tensors and its attention factor
``rope.scaling.attn_factor``. Partial rotary embeddings (Phi-4-mini) and YaRN are refused.
A sliding window shorter than the context applies to every layer (as transformers does);
llama.cpp's converter writes it as ``attention.sliding_window`` (0: none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from furnace_trio.loading.model_config import LongRope, UnsupportedModelError, sliding_all
from furnace_trio.loading.tensors import TensorRecord, to_float

__all__ = ["gguf_phi3_fields", "hf_phi3_fields", "split_fused"]


def hf_phi3_fields(raw: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's :class:`ModelConfig` fields from a ``config.json`` and its rope parameters."""
    partial = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        raise UnsupportedModelError(
            f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported"
        )
    context = int(raw.get("max_position_embeddings", 4096))
    fields = sliding_all(raw.get("sliding_window"), context, int(raw["num_hidden_layers"]))
    kind = (rope.get("rope_type") or rope.get("type") or "default").lower()
    if kind == "default":
        return fields
    if kind not in ("longrope", "su"):
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r} for Phi-3 (default and longrope are)"
        )
    original = int(
        rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    )
    factor = float(rope.get("factor") or context / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    fields["longrope"] = LongRope(
        short_factor=tuple(float(f) for f in rope["short_factor"]),
        long_factor=tuple(float(f) for f in rope["long_factor"]),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
    )
    return fields


def gguf_phi3_fields(
    meta: Mapping[str, Any], tensors: Mapping[str, TensorRecord], layers: int, context: int
) -> dict[str, Any]:
    """Phi-3's :class:`ModelConfig` fields from a GGUF's metadata and rope factor tensors."""
    rope_dims = meta.get("phi3.rope.dimension_count")
    key_length = meta.get("phi3.attention.key_length")
    head_dim = key_length or int(meta["phi3.embedding_length"]) // int(
        meta["phi3.attention.head_count"]
    )
    if rope_dims is not None and int(rope_dims) != int(head_dim):
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not supported"
        )
    fields = sliding_all(meta.get("phi3.attention.sliding_window"), context, layers)
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None and short is None:
        return fields
    if long is None or short is None:
        raise UnsupportedModelError("one of rope_factors_long and rope_factors_short is missing")
    original = int(meta.get("phi3.rope.scaling.original_context_length", context))
    fields["longrope"] = LongRope(
        short_factor=_factors(short),
        long_factor=_factors(long),
        original_max_position_embeddings=original,
        attention_factor=float(meta.get("phi3.rope.scaling.attn_factor", 1.0)),
    )
    return fields


def _factors(record: TensorRecord) -> tuple[float, ...]:
    raw = record.file.read(record.offset, record.n_bytes)
    values = to_float(raw, record.ggml_type, record.shape, record.name)
    return tuple(float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1))


def split_fused(
    record: TensorRecord, prefix: str, kind: str, sizes: tuple[int, int, int], ff: int
) -> dict[str, TensorRecord]:
    """The parts of a fused projection under Llama's names: ``kind`` ``qkv`` splits into
    q, k and v (``sizes``: their rows), ``gate_up`` into gate and up (``ff`` rows each);
    ``prefix``: ``model.layers.{i}``."""
    if kind == "qkv":
        names = [f"{prefix}.self_attn.{p}_proj.weight" for p in ("q", "k", "v")]
        rows = list(sizes)
    else:
        names = [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")]
        rows = [ff, ff]
    if sum(rows) != record.shape[0]:
        raise UnsupportedModelError(
            f"{record.name}: {record.shape[0]} rows, expected {' + '.join(map(str, rows))}"
        )
    out: dict[str, TensorRecord] = {}
    start = 0
    for name, count in zip(names, rows, strict=True):
        out[name] = record.rows_at(name, start, count)
        start += count
    return out
