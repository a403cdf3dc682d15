"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end in the runtime."""

from __future__ import annotations

import pytest
import torch

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.loader import LoadedModel
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig


@pytest.fixture(scope="module")
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner.from_loaded(loaded, RunnerConfig(device="cpu", kv_cache_bytes=64 << 20))


def _greedy(runner: ModelRunner, prompt: list[int], steps: int, eos: frozenset[int]) -> list[int]:
    table = tuple(range(runner.num_blocks))[: -(-(len(prompt) + steps) // runner.block_size)]
    logits = runner.logits(StepPlan((ChunkPlan(1, tuple(prompt), 0, table),)))
    out: list[int] = []
    for _ in range(steps):
        token = int(logits[0].argmax())
        if token in eos:
            break
        out.append(token)
        pos = len(prompt) + len(out) - 1
        logits = runner.logits(StepPlan((ChunkPlan(1, (token,), pos, table),)))
    return out


def test_default_model_answers_paris(loaded: LoadedModel, runner: ModelRunner) -> None:
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    answer = tok.decode(_greedy(runner, prompt, 40, tok.eos_token_ids))
    assert "Paris" in answer


def test_default_model_logits_match_transformers(loaded: LoadedModel, runner: ModelRunner) -> None:
    """transformers' Llama on the same dequantized weights gives the same logits.

    That the dequantized weights equal transformers' own reading of the GGUF is checked in
    test_gguf_loader; here the whole forward pass (30 layers, GQA, tied head) is compared.
    """
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
        tie_word_embeddings=True,
    )
    ref = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = ref.load_state_dict(loaded.weights, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ref.tie_weights()
    ids = loaded.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog, and then", add_special_tokens=False
    )
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    table = tuple(range(8))
    got = runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:-3]), 0, table),)))
    torch.testing.assert_close(got[0], expected[len(ids) - 4], atol=1e-3, rtol=1e-3)
    for i in range(len(ids) - 3, len(ids)):
        got = runner.logits(StepPlan((ChunkPlan(1, (ids[i],), i, table),)))
        torch.testing.assert_close(got[0], expected[i], atol=1e-3, rtol=1e-3)
    assert int(got[0].argmax()) == int(expected[-1].argmax())
