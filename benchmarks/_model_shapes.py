"""Real-size model files for the benchmarks, built here: random weights in a real shape.

No model hub is reachable from the machines this project runs on, so the benchmarks make
their own: a Hugging Face directory with a config of a known model's shape (``1b``:
Llama-3.2-1B's; ``8b``: Llama-3.1-8B's), random weights in bfloat16, and the default
model's tokenizer (SmolLM2's 49,152-token vocabulary, rebuilt from its GGUF). llama.cpp's
own ``convert_hf_to_gguf.py`` and ``llama-quantize`` (from the llama-cpp-python sources
that ``_llama_server.py`` builds) turn it into a GGUF of the asked type, the file both
servers then load. Files are cached under ``build/models/``.

    python benchmarks/_model_shapes.py 1b Q4_K_M     # prints the GGUF's path
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _llama_server import build_llama_tool, llama_cpp_source
from safetensors.torch import save_file

from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.gguf_file import read_gguf
from furnace_trio.loading.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "build" / "models"
INDEX = "model.safetensors.index.json"

SHAPES: dict[str, dict[str, int | float | bool]] = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}


def hf_directory(shape: str) -> Path:
    """The shape's Hugging Face directory (config, tokenizer, random bfloat16 weights)."""
    out = MODELS / f"llama-{shape}-random"
    if (out / INDEX).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(SHAPES[shape], "LlamaForCausalLM", "llama", write_tokenizer(out))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_shards(out, random_weights(config), 1 + int(config["num_hidden_layers"]))
    return out


def hf_config(
    dims: dict[str, int | float | bool], architecture: str, model_type: str, vocab: dict[str, int]
) -> dict[str, Any]:
    """A ``config.json`` of ``dims`` (a shape) for ``architecture``, ``vocab`` the tokenizer's
    fields (:func:`write_tokenizer`), Llama 3's rope base and bfloat16."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "head_dim": int(dims["hidden_size"]) // int(dims["num_attention_heads"]),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        **dims,
    }


def write_tokenizer(out: Path) -> dict[str, int]:
    """The default model's tokenizer as Hugging Face files in ``out``; the config's
    ``vocab_size``, ``bos_token_id`` and ``eos_token_id`` for it."""
    source = default_model_path()
    metadata = read_gguf(source).metadata
    tokenizer = Tokenizer.from_gguf(source)
    tokenizer.hf_tokenizer.save(str(out / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    bos = tokens[int(metadata["tokenizer.ggml.bos_token_id"])]
    eos = tokens[int(metadata["tokenizer.ggml.eos_token_id"])]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": bos,
                "eos_token": eos,
                "chat_template": metadata.get("tokenizer.chat_template"),
                "model_max_length": 8192,
            }
        )
    )
    return {
        "vocab_size": tokenizer.hf_tokenizer.get_vocab_size(),
        "bos_token_id": tokens.index(bos),
        "eos_token_id": tokens.index(eos),
    }


def write_shards(out: Path, parts: Iterator[dict[str, torch.Tensor]], count: int) -> None:
    """One safetensors file per part, and the index that names each tensor's file (as
    ``save_pretrained`` shards), so that no more than one part is ever in memory: an
    8B shape is 16 GB of bfloat16."""
    weight_map: dict[str, str] = {}
    for number, part in enumerate(parts, start=1):
        name = f"model-{number:05d}-of-{count:05d}.safetensors"
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def random_weights(config: dict) -> Iterator[dict[str, torch.Tensor]]:
    """Gaussian weights (std 0.02, as Llama's initialisation), unit norms, bfloat16: the
    embeddings, norm and head first, then one layer at a time."""
    generator = torch.Generator().manual_seed(0)
    hidden, ff = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    weights["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    yield weights
    for i in range(config["num_hidden_layers"]):
        weights = {}
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        weights[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        weights[p + "mlp.gate_proj.weight"] = normal(ff, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(ff, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, ff)
        yield weights


def gguf_file(shape: str, quant: str = "Q4_K_M") -> Path:
    """The shape as a GGUF of type ``quant`` (llama.cpp's converter and quantizer)."""
    target = MODELS / f"llama-{shape}-random-{quant}.gguf"
    if target.is_file():
        return target
    directory = hf_directory(shape)
    f16 = MODELS / f"llama-{shape}-random-F16.gguf"
    tree = llama_cpp_source()
    if not f16.is_file():
        env_path = str(tree / "gguf-py")
        subprocess.run(
            [
                sys.executable,
                str(tree / "convert_hf_to_gguf.py"),
                str(directory),
                "--outtype",
                "f16",
                "--outfile",
                str(f16),
            ],
            check=True,
            env={**__import__("os").environ, "PYTHONPATH": env_path},
        )
    if quant != "F16":
        quantize = build_llama_tool("llama-quantize")
        subprocess.run([str(quantize), str(f16), str(target), quant], check=True)
    return target


if __name__ == "__main__":
    print(gguf_file(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "Q4_K_M"))
