"""The CUDA path of the runtime (run with ``pytest -m gpu`` on a machine with a GPU)."""

from __future__ import annotations

import pytest
import torch

from furnace_trio.params import SamplingParams
from furnace_trio.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runner import ModelRunner, RunnerConfig

from .real_model import default_model, default_runner

pytestmark = pytest.mark.gpu


def _cuda_runner(dtype: str) -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(),
        RunnerConfig(device="cuda", dtype=dtype, kv_cache_bytes=256 << 20),
    )


def _prompt() -> tuple[int, ...]:
    tok = default_model().tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    )
    return tuple(tok.encode(text, add_special_tokens=False))


def test_cuda_float32_logits_match_the_cpu() -> None:
    ids = _prompt()
    plan = StepPlan((ChunkPlan(1, ids, 0, tuple(range(8))),))
    cpu = default_runner().logits(plan)
    gpu = _cuda_runner("float32").logits(plan)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-3, rtol=2e-3)


def test_cuda_bfloat16_greedy_answer_says_paris() -> None:
    runner = _cuda_runner("bfloat16")
    tok = default_model().tokenizer
    ids = _prompt()
    table = tuple(range(8))
    greedy = SamplingParams(temperature=0, max_tokens=40)
    out: list[int] = []
    chunk = ChunkPlan(1, ids, 0, table, (SampleSpec(1, greedy),))
    for _ in range(40):
        (sampled,) = runner.step(StepPlan((chunk,)))
        if sampled.token_id in tok.eos_token_ids:
            break
        out.append(sampled.token_id)
        chunk = ChunkPlan(
            1, (sampled.token_id,), len(ids) + len(out) - 1, table, (SampleSpec(1, greedy),)
        )
    assert "Paris" in tok.decode(out)
