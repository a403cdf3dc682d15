"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): config and tensor names.

Every loader hands the runtime one name per expert weight, Qwen's, whatever the file
calls it::

    model.layers.{i}.mlp.gate.weight                      router [experts, hidden]
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight   (Qwen2-MoE)
    model.layers.{i}.mlp.shared_expert_gate.weight        [1, hidden] (Qwen2-MoE)

Mixtral's Hugging Face names (``block_sparse_moe.experts.{e}.w1/w3/w2``, gate/up/down) are
renamed. llama.cpp stacks a layer's experts into one tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``, ``[experts, out, in]`` in torch
order); each expert's part is a contiguous run of its bytes, so it becomes a record of its
own (:meth:`~furnace_trio.loading.tensors.TensorRecord.part`), quantized blocks and all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from furnace_trio.loading.model_config import MoE, UnsupportedModelError
from furnace_trio.loading.tensors import TensorRecord

__all__ = ["gguf_moe", "gguf_moe_records", "hf_moe", "hf_moe_records"]

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# llama.cpp's per-layer MoE tensors -> the Hugging Face (Qwen) module names.
_GGUF_STACKED = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GGUF_SINGLE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Whether llama.cpp renormalizes the top-k weights, per GGUF architecture, where the file
# does not say (``{arch}.expert_weights_norm``).
_GGUF_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def hf_moe(arch: str, raw: Mapping[str, Any]) -> MoE:
    """The :class:`MoE` of a Hugging Face ``config.json`` (``arch`` already mapped)."""
    layers = int(raw["num_hidden_layers"])
    if arch == "mixtral":
        return MoE(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoE(
        num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2moe"
        else 0,
        layers=() if all(sparse) else sparse,
    )


def hf_moe_records(records: Mapping[str, TensorRecord], moe: MoE) -> dict[str, TensorRecord]:
    """``records`` under the runtime's expert names: Mixtral's renamed, and experts stored
    stacked (``mlp.experts.gate_up_proj`` ``[experts, 2 * ff, hidden]``, ``down_proj``)
    split into one record per expert."""
    out: dict[str, TensorRecord] = {}
    for name, record in records.items():
        if ".block_sparse_moe." in name:
            head, tail = name.split(".block_sparse_moe.", 1)
            parts = tail.split(".")
            if parts[0] == "experts" and len(parts) == 4 and parts[2] in _MIXTRAL_EXPERT:
                tail = f"experts.{parts[1]}.{_MIXTRAL_EXPERT[parts[2]]}.{parts[3]}"
            name = f"{head}.mlp.{tail}"
            out[name] = TensorRecord(name, *_fields(record))
        elif name.endswith(".mlp.experts.gate_up_proj") and len(record.shape) == 3:
            prefix = name.removesuffix("gate_up_proj")
            ff = record.shape[1] // 2
            for e in range(moe.num_experts):
                stacked = record.part(f"{prefix}{e}.gate_up", e, moe.num_experts)
                for i, proj in enumerate(("gate_proj", "up_proj")):
                    part = f"{prefix}{e}.{proj}.weight"
                    out[part] = stacked.rows_at(part, i * ff, ff)
        elif name.endswith(".mlp.experts.down_proj") and len(record.shape) == 3:
            prefix = name.removesuffix("down_proj")
            for e in range(moe.num_experts):
                part = f"{prefix}{e}.down_proj.weight"
                out[part] = record.part(part, e, moe.num_experts)
        else:
            out[name] = record
    return out


def _fields(record: TensorRecord) -> tuple[Any, ...]:
    return (record.shape, record.ggml_type, record.file, record.offset, record.n_bytes)


def gguf_moe(
    meta: Mapping[str, Any], gguf_arch: str, layers: int, sparse: list[bool], ff: int
) -> MoE | None:
    """The :class:`MoE` of a GGUF's metadata (``None`` without ``{arch}.expert_count``);
    ``sparse``: which layers have a router tensor; ``ff``: the dense feed-forward size."""
    count = int(meta.get(f"{gguf_arch}.expert_count", 0) or 0)
    if count == 0:
        return None
    if gguf_arch not in _GGUF_NORM:
        raise UnsupportedModelError(f"experts in a {gguf_arch!r} GGUF are not supported")
    gating = meta.get(f"{gguf_arch}.expert_gating_func")
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModelError(f"expert gating function {gating} (only softmax)")
    used = int(meta[f"{gguf_arch}.expert_used_count"])
    size = int(meta.get(f"{gguf_arch}.expert_feed_forward_length", ff))
    shared = int(meta.get(f"{gguf_arch}.expert_shared_feed_forward_length", 0) or 0)
    norm = bool(meta.get(f"{gguf_arch}.expert_weights_norm", _GGUF_NORM[gguf_arch]))
    return MoE(
        num_experts=count,
        top_k=used,
        intermediate_size=size,
        norm_topk_prob=norm,
        shared_intermediate_size=shared,
        layers=() if all(sparse) else tuple(sparse),
    )


def gguf_moe_records(
    layer: str, kind: str, record: TensorRecord, moe: MoE | None
) -> dict[str, TensorRecord] | None:
    """The records of GGUF tensor ``blk.{layer}.{kind}.weight`` when it is an MoE tensor
    (``None`` otherwise): stacked experts split one per expert, the others renamed."""
    prefix = f"model.layers.{layer}"
    if kind in _GGUF_SINGLE:
        name = f"{prefix}.{_GGUF_SINGLE[kind]}.weight"
        shape = record.shape
        if kind == "ffn_gate_inp_shexp":
            shape = (1, shape[-1])  # stored 1-D or [1, hidden]
        return {name: TensorRecord(name, shape, *_fields(record)[1:])}
    if kind not in _GGUF_STACKED:
        return None
    if moe is None:
        raise UnsupportedModelError(f"{record.name}: stacked experts without expert_count")
    out = {}
    for e in range(moe.num_experts):
        name = f"{prefix}.mlp.experts.{e}.{_GGUF_STACKED[kind]}.weight"
        out[name] = record.part(name, e, moe.num_experts)
    return out


def moe_weight_names(prefix: str, moe: MoE) -> list[str]:
    """Every weight name of one sparse layer's feed-forward (completeness checks)."""
    names = [f"{prefix}.mlp.gate.weight"]
    for e in range(moe.num_experts):
        names += [
            f"{prefix}.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
        ]
    if moe.shared_intermediate_size:
        names += [
            f"{prefix}.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
        ]
        names.append(f"{prefix}.mlp.shared_expert_gate.weight")
    return names
