"""The CUDA path of the runtime (run with ``pytest -m gpu`` on a machine with a GPU)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import trio

from furnace_trio.app import create_app
from furnace_trio.backend import DEFAULT_KV_CACHE_MB_CPU
from furnace_trio.config import ServerConfig
from furnace_trio.model import KVCache
from furnace_trio.params import SamplingParams
from furnace_trio.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runner import ModelRunner, RunnerConfig

from .http_server import serve_app
from .real_model import NAME, QUESTION, check_paris_streamed_and_not, default_model, default_runner
from .test_cuda_graphs import fresh_graphs

pytestmark = pytest.mark.gpu


def _cuda_runner(dtype: str) -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(),
        RunnerConfig(device="cuda", dtype=dtype, kv_cache_bytes=256 << 20),
    )


def _prompt() -> tuple[int, ...]:
    tok = default_model().tokenizer
    text = tok.apply_chat_template(QUESTION)
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
    # The decodes were graph replays (a runner on CUDA captures them by default).
    assert runner.graphs is not None and runner.graphs.captured == ((1, 256),)


def test_cuda_graph_replays_compute_the_eager_padded_step() -> None:
    """A captured decode step gives what the same padded step gives launched op by op:
    3 sequences (a batch of 4 with one padding row), 24 steps, tokens fed back."""
    ids = _prompt()
    captured, eager = _cuda_runner("bfloat16"), _cuda_runner("bfloat16")
    eager.graphs = fresh_graphs(eager, capture=False)
    prompts = [ids, ids[:9], ids[5:]]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    last = []
    for runner in (captured, eager):
        for seq, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
            logits = runner.logits(StepPlan((ChunkPlan(seq, prompt, 0, table),)))
            if runner is captured:
                last.append(int(logits[0].argmax()))
    greedy = SamplingParams(temperature=0, max_tokens=24)
    worst = 0.0
    for step in range(24):
        plan = StepPlan(
            tuple(
                ChunkPlan(
                    s, (last[s],), len(prompts[s]) + step, tables[s], (SampleSpec(s, greedy),)
                )
                for s in range(3)
            )
        )
        assert captured.graphs is not None
        got = captured.graphs.run(plan).clone()
        want = eager.graphs.run(plan)
        worst = max(worst, float((got - want).abs().max()))
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        last = got.argmax(-1).tolist()
    assert worst <= 1e-3, worst
    assert captured.graphs is not None and captured.graphs.captured == ((4, 256),)


async def test_the_server_on_cuda_serves_the_sdk_as_users_run_it() -> None:
    """``FURNACE_DEVICE=cuda``: the app loads the default model onto the GPU itself (bfloat16,
    no quantization, the KV cache sized from the device's free memory) and serves chat,
    streamed and not, and concurrent requests in one batch."""
    default_model()  # skips with the CPU tests' reason where the model package is absent
    async with (
        serve_app(create_app(ServerConfig(device="cuda"))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        await check_paris_streamed_and_not(client, NAME)

        # Sized from the GPU's free memory, not the CPU default.
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{url}/metrics")).text.splitlines()
        (total,) = [m for m in metrics if m.startswith("furnace_kv_blocks_total ")]
        per_block = KVCache.bytes_per_block(default_model().config, 16, torch.bfloat16)
        assert int(float(total.split()[1])) * per_block > DEFAULT_KV_CACHE_MB_CPU << 20

        counts: list[int] = []

        async def one(i: int) -> None:
            r = await client.completions.create(
                model=NAME,
                prompt=f"Item {i}: a short story about a lighthouse.",
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.usage is not None
            counts.append(r.usage.completion_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        assert counts == [24] * 16
