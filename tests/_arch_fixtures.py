"""Tiny random Phi-3 and mixture-of-experts models, as Hugging Face directories and GGUFs.

:func:`write_arch_model` writes what ``transformers`` loads offline (with the tiny tokenizer
of :mod:`tests._model_fixtures`); :func:`write_arch_gguf` writes the same weights the way
llama.cpp's ``convert_hf_to_gguf.py`` does for these architectures: Phi-3's fused
``attn_qkv`` and ``ffn_up`` (gate rows then up rows) and LongRoPE's factor tensors, the
experts of a layer stacked into ``ffn_{gate,up,down}_exps`` (``[experts, out, in]``), the
router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as ``*_shexp``, Mixtral as a
``llama`` GGUF (q/k rows permuted) with ``expert_count``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ._model_fixtures import (
    TINY_VOCAB,
    _write_tokenizer,
    llama_cpp_permute,
)

#: name -> (architecture, transformers config class, extra config arguments)
ARCHES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "phi3": ("phi3", "Phi3Config", {"intermediate_size": 96, "pad_token_id": 1}),
    "phi3-longrope": (
        "phi3",
        "Phi3Config",
        {
            "intermediate_size": 96,
            "pad_token_id": 1,
            "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
                "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
            },
        },
    ),
    "phi3-window": (
        "phi3",
        "Phi3Config",
        {"intermediate_size": 96, "pad_token_id": 1, "sliding_window": 6},
    ),
    "mixtral": (
        "mixtral",
        "MixtralConfig",
        {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2moe": (
        "qwen2moe",
        "Qwen2MoeConfig",
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
        },
    ),
    "qwen3moe": (
        "qwen3moe",
        "Qwen3MoeConfig",
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "head_dim": 24,
            "mlp_only_layers": [1],  # a dense layer between sparse ones
            "num_hidden_layers": 3,
        },
    ),
}


def arch_config(name: str) -> Any:
    import transformers

    _, cls, extra = ARCHES[name]
    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
    )
    kwargs.update(extra)
    return getattr(transformers, cls)(**kwargs)


def write_arch_model(tmp_path: Path, name: str) -> Path:
    """A tiny random ``name`` model (one of :data:`ARCHES`) with the tiny tokenizer.

    Seeded; norms and biases randomized around one; router weights scaled up so that each
    token's top-k experts are chosen by clear margins (near-ties would let the rounding of
    two correct implementations pick different experts)."""
    import transformers

    config = arch_config(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param_name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.copy_(torch.randn_like(param))
            elif "shared_expert_gate" in param_name:
                param.copy_(0.5 * torch.randn_like(param))
    directory = tmp_path / f"tiny-{name}"
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def write_arch_gguf(tmp_path: Path, name: str, qtype: Any = None) -> tuple[Path, Path]:
    """:func:`write_arch_model`'s model and a GGUF of it (see the module docstring);
    ``qtype``: every 2-D and stacked weight in that GGML type (float32 when ``None``)."""
    import gguf
    import numpy as np
    import transformers

    directory = write_arch_model(tmp_path, name)
    arch = ARCHES[name][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    config = model.config
    gguf_arch = "llama" if arch == "mixtral" else arch
    suffix = "" if qtype is None else f".{qtype.name}"
    path = tmp_path / f"tiny-{name}{suffix}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(config.sliding_window or 0)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch in ("mixtral", "qwen2moe", "qwen3moe"):
        experts = getattr(config, "num_local_experts", None) or config.num_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch != "mixtral":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    tok = _tokenizer_metadata(directory, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok[0])
    writer.add_token_merges(tok[1])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    def add(gguf_name: str, data: torch.Tensor) -> None:
        values = data.detach().float().numpy()
        if qtype is None or values.ndim < 2 or "gate_inp" in gguf_name:
            writer.add_tensor(gguf_name, values)
        else:
            blocks = gguf.quants.quantize(values, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)

    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "model.embed_tokens.weight":
            add("token_embd.weight", tensor)
            continue
        if hf_name == "model.norm.weight":
            add("output_norm.weight", tensor)
            continue
        if hf_name == "lm_head.weight":
            add("output.weight", tensor)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module = rest.rsplit(".", 1)[0]
        if rest == "mlp.experts.gate_up_proj":  # transformers' own [experts, 2 * ff, hidden]
            gate, up = tensor.chunk(2, dim=1)
            add(f"blk.{layer}.ffn_gate_exps.weight", gate)
            add(f"blk.{layer}.ffn_up_exps.weight", up)
            continue
        if rest == "mlp.experts.down_proj":
            add(f"blk.{layer}.ffn_down_exps.weight", tensor)
            continue
        data = tensor
        if gguf_arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            data = llama_cpp_permute(tensor, n_head if "q_proj" in module else n_kv)
        add(f"blk.{layer}.{_BLOCK[module]}.{rest.rsplit('.', 1)[1]}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory, path


def _tokenizer_metadata(directory: Path, config: Any) -> tuple[list[str], list[str]]:
    import json

    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, merges
