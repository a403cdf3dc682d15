"""Tiny random models on disk, for loader tests and forward-pass comparisons.

:func:`write_tiny_model` writes a Hugging Face directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads offline, with a small byte-level
BPE ``tokenizer.json`` and a ``tokenizer_config.json`` carrying a ChatML chat template.
:func:`transformers_gguf_state_dict` is transformers' own GGUF dequantization (the
reference for our GGUF loader); it avoids ``from_pretrained(gguf_file=...)``, which in
transformers 5 requires ``accelerate`` (not installed here).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_VOCAB = 320
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
#: The tiny Gemma 3's sliding window: shorter than the tests' sequences, so it matters.
GEMMA3_WINDOW = 6
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Trio is a friendly Python library for async concurrency and I/O.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600",
]


def tiny_hf_config(arch: str, *, tied: bool, rope_llama3: bool = False) -> Any:
    """A transformers config of ``arch`` with tiny sizes (GQA, 2 layers, vocab 320).

    ``gemma3`` (text-only, ``Gemma3ForCausalLM``) has 6 layers, so that its standard pattern
    has a global layer after five sliding ones, a window of :data:`GEMMA3_WINDOW`, and a
    final logit softcap (Gemma 2's, which Gemma 3's code keeps). ``rope_llama3`` scales the
    rope: llama3's for ``llama``, linear (x8, the global layers, as Gemma 3 4B) for ``gemma3``."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=2,
    )
    if arch in ("qwen3", "gemma3"):
        kwargs["head_dim"] = 24  # decoupled from hidden_size // num_heads (16), as in Qwen3
    if arch == "gemma3":
        kwargs.update(
            num_hidden_layers=6,
            sliding_window=GEMMA3_WINDOW,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            pad_token_id=1,
        )
    if rope_llama3 and arch == "gemma3":
        kwargs["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    elif rope_llama3:
        if arch != "llama":
            raise ValueError("llama3 rope scaling is only for the llama architecture")
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    return classes[arch](**kwargs)


def write_tiny_model(
    tmp_path: Path, arch: str, *, tied: bool, rope_llama3: bool = False, sharded: bool = False
) -> Path:
    """Write a tiny random ``arch`` model (+ tokenizer) under ``tmp_path`` and return its dir.

    Weights are random but seeded (``torch.manual_seed(0)``), and the norms are randomized
    too so a loader that drops or swaps them is caught. ``sharded`` splits the safetensors
    into several files with a ``model.safetensors.index.json``.
    """
    import transformers

    config = tiny_hf_config(arch, tied=tied, rope_llama3=rope_llama3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    name = f"tiny-{arch}{'-tied' if tied else ''}{'-llama3' if rope_llama3 else ''}"
    directory = tmp_path / (name + ("-sharded" if sharded else ""))
    model.save_pretrained(
        directory, safe_serialization=True, max_shard_size="40KB" if sharded else "10GB"
    )
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if tokenizer.get_vocab_size() > TINY_VOCAB:
        raise ValueError("tiny tokenizer is larger than the tiny model's vocabulary")
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "unk_token": None,
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def transformers_gguf_state_dict(path: Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """transformers' dequantized, un-permuted state dict of a GGUF (float32).

    ``hf_config`` is the transformers config of the model (it only names the tensors and
    gives the head counts for the un-permutation).
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    return {name: torch.as_tensor(t).float() for name, t in tensors["tensors"].items()}


# Hugging Face name -> GGUF name, per layer (the inverse of the GGUF loader's table).
_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GEMMA3_BLOCK_NAMES = {
    **_GGUF_BLOCK_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp tensor name of a Hugging Face Llama-family or Gemma 3 weight."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _GGUF_GEMMA3_BLOCK_NAMES if arch == "gemma3" else _GGUF_BLOCK_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``convert_hf_to_gguf.LlamaModel.permute`` (rotate-half -> interleaved)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_freqs(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """The ``rope_freqs.weight`` tensor llama.cpp's converter writes for llama3 scaling."""
    import math

    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (theta ** (-i / head_dim))
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def write_gguf(
    path: Path,
    config: Any,
    state_dict: dict[str, torch.Tensor],
    *,
    architecture: str | None = None,
    tokenizer_dir: Path | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    qtype: Any = None,
) -> Path:
    """Write a GGUF of a transformers state dict the way llama.cpp's converter does.

    Q/K weights and biases are permuted for the ``llama`` architecture (also Mistral's,
    which llama.cpp writes as ``llama``); Qwen2/Qwen3 are written as is. Gemma 3 (from its
    ``gemma3_text`` config) as llama.cpp's ``Gemma3Model``: one added to every norm
    weight, the sliding window and final logit softcap in the metadata. A tied
    ``lm_head.weight`` is omitted. Tensors are float32, or with ``qtype`` (a
    ``gguf.GGMLQuantizationType``) every 2-D weight is stored in that type (``F16``, or
    blocks ``gguf.quants.quantize`` writes), after the permutation, as llama.cpp does. With ``tokenizer_dir``, its ``tokenizer.json`` vocabulary
    and merges go into the ``tokenizer.ggml.*`` metadata (model ``gpt2``).
    """
    import gguf

    model_type = config.model_type
    renamed = {"mistral": "llama", "gemma3_text": "gemma3"}
    arch = architecture or renamed.get(model_type, model_type)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    if arch == "gemma3":
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))))
    if tokenizer_dir is not None:
        tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        for added in tok.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
        for token, index in vocab.items():
            tokens[index] = token
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(config.bos_token_id)
        writer.add_eos_token_id(config.eos_token_id)
        writer.add_chat_template(CHAT_TEMPLATE)
    tied = config.tie_word_embeddings
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.detach().float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # Gemma3RMSNorm's (1 + weight), as the converter folds it
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, n_head if ".q_proj." in name else n_kv)
        if qtype is None or data.dim() != 2:
            writer.add_tensor(gguf_name(name, arch), data.numpy())
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name, arch), data.numpy().astype("float16"))
        else:
            blocks = gguf.quants.quantize(data.numpy(), qtype)
            writer.add_tensor(gguf_name(name, arch), blocks, raw_dtype=qtype)
    for name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(
    tmp_path: Path, arch: str, *, tied: bool, qtype: Any = None, scaled_rope: bool = False
) -> Path:
    """A GGUF of :func:`write_tiny_model`'s model (same weights, with tokenizer): float32,
    or its 2-D weights in ``qtype`` (see :func:`write_gguf`); ``scaled_rope``: Gemma 3's
    linear rope scaling."""
    import transformers

    directory = write_tiny_model(tmp_path, arch, tied=tied, rope_llama3=scaled_rope)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    suffix = "" if qtype is None else f".{qtype.name}"
    path = tmp_path / f"{directory.name}{suffix}.gguf"
    return write_gguf(path, model.config, model.state_dict(), tokenizer_dir=directory, qtype=qtype)


def write_random_gguf(
    path: Path,
    *,
    layers: int,
    hidden: int,
    ff: int,
    vocab: int,
    qtype_of: Callable[[str], Any] | None = None,
) -> int:
    """A tied llama GGUF of random weights (4 heads, 2 KV heads), each 2-D weight in
    ``qtype_of(its GGUF name)``. Returns the float32 bytes of its weights."""
    import gguf
    import numpy as np

    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    total = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal total
        total += 4 * int(np.prod(shape))
        values = rng.standard_normal(shape, dtype=np.float32) * 0.05
        qtype = gguf.GGMLQuantizationType.Q8_0 if qtype_of is None else qtype_of(name)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", (ff, hidden))
        add(f"blk.{i}.ffn_up.weight", (ff, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total
