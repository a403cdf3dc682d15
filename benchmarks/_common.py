"""Shared pieces of the benchmarks: prompts, percentiles, the transformers reference model."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch

from furnace_trio.loading.loader import LoadedModel
from furnace_trio.runtime.runner import RunnerConfig

PROMPTS: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a beginner.",
    "List three uses of copper.",
    "How do airplanes stay in the air?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and French.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "What is photosynthesis?",
    "Suggest a name for a small coffee shop.",
    "How many legs does a spider have, and why?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "Explain recursion with a simple example.",
)


def split_runtime(runtime: str) -> tuple[str, bool, str]:
    """A benchmark runtime name -> (quantization, native kernels, KV cache dtype): a
    quantization (``q4``, ``int8``, ``none``), or one with ``-torch`` (``int8-torch``,
    ``none-torch``): the same without the native kernels (the baseline before them);
    ``+kv8`` (``q4+kv8``) adds an int8 KV cache."""
    name, plus, kv = runtime.partition("+")
    if plus and kv != "kv8":
        raise ValueError(f"unknown runtime suffix in {runtime!r} (only +kv8)")
    quantization, _, kernels = name.partition("-")
    return quantization, kernels != "torch", "int8" if plus else "auto"


def runtime_config(runtime: str, kv_cache_bytes: int = 512 << 20) -> RunnerConfig:
    """The CPU runner for a benchmark runtime name (:func:`split_runtime`)."""
    quantization, native, kv_dtype = split_runtime(runtime)
    return RunnerConfig(
        device="cpu",
        kv_cache_bytes=kv_cache_bytes,
        quantization=quantization,
        native=native,
        kv_dtype=kv_dtype,
    )


def chat_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "perplexity.txt")


def long_prompt_text(prefix: str = "") -> str:
    """About 1,000 tokens of plain text (the test paragraph twice) after ``prefix``, for
    prefill over HTTP."""
    with open(TEXT) as text:
        return prefix + " ".join([text.read()] * 2)


def long_prompt_ids(loaded: LoadedModel, n: int = 1000) -> list[int]:
    """Exactly ``n`` tokens of plain text (a paragraph repeated), for prefill speed."""
    with open(TEXT) as text:
        ids = loaded.tokenizer.encode(text.read(), add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def transformers_model(loaded: LoadedModel) -> Any:
    """transformers' LlamaForCausalLM on our loaded float32 weights (no accelerate needed)."""
    import transformers

    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(dict(loaded.weights), strict=False)
    model.tie_weights()
    return model


def bandwidth(rounds: int) -> tuple[float, float]:
    """GB/s of a float32 sum over 1 GiB and of a 512 MiB copy (bytes read + written)."""
    big = torch.ones(2**28, dtype=torch.float32)
    half = big[: 2**27]
    dst = torch.empty_like(half)
    sums, copies = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        big.sum()
        sums.append(big.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(half)
        copies.append(2 * half.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return max(sums), max(copies)
