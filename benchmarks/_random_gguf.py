"""A model shape of ``_model_shapes.py`` as a GGUF of random valid K-quant blocks, without
llama.cpp: the tensor types of llama-quantize's Q4_K_M (Q4_K, with Q6_K for the tied
embedding / LM head and for ``attn_v`` and ``ffn_down`` in the layers its
``use_more_bits`` picks), random code and scale bytes (tests/runtime/test_blocks.py's
``random_blocks``) and SmolLM2's tokenizer. For kernel and step timings (bench_step.py
``--model``), where the weights' values do not matter; the servers' comparison uses
``_model_shapes.py``'s file from llama.cpp's own quantizer.

    python benchmarks/_random_gguf.py 1b     # prints the GGUF's path
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _model_shapes import MODELS, SHAPES

from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.gguf_file import read_gguf
from runtime.test_blocks import random_blocks


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _add_metadata(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))


def random_gguf(shape: str) -> Path:
    out = MODELS / f"llama-{shape}-random-blocks-Q4_K_M.gguf"
    if out.is_file():
        return out
    MODELS.mkdir(parents=True, exist_ok=True)
    dims = SHAPES[shape]
    hidden, ff = int(dims["hidden_size"]), int(dims["intermediate_size"])
    layers, heads = int(dims["num_hidden_layers"]), int(dims["num_attention_heads"])
    kv_heads = int(dims["num_key_value_heads"])
    head_dim = hidden // heads
    metadata = read_gguf(default_model_path()).metadata
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = len(tokens)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in metadata.items():
        if key.startswith("tokenizer."):
            _add_metadata(writer, key, value)
    rng = np.random.default_rng(0)

    def add(name: str, rows: int, cols: int, qtype: T) -> None:
        blocks = random_blocks(qtype, rows, cols, rng, 1.0 / np.sqrt(cols))
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=qtype)

    add("token_embd.weight", vocab, hidden, T.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        more = T.Q6_K if _more_bits(i, layers) else T.Q4_K
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", hidden, hidden, T.Q4_K)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, T.Q4_K)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, more)
        add(f"blk.{i}.attn_output.weight", hidden, hidden, T.Q4_K)
        add(f"blk.{i}.ffn_gate.weight", ff, hidden, T.Q4_K)
        add(f"blk.{i}.ffn_up.weight", ff, hidden, T.Q4_K)
        add(f"blk.{i}.ffn_down.weight", hidden, ff, more)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


if __name__ == "__main__":
    print(random_gguf(sys.argv[1] if len(sys.argv) > 1 else "1b"))
