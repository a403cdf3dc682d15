"""The CUDA path of the runtime (run with ``pytest -m gpu`` on a machine with a GPU)."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
import torch
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runtime.kv_cache import KVCache
from furnace_trio.runtime.model import Transformer
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.app import create_app
from furnace_trio.server.backend import DEFAULT_KV_CACHE_MB_CPU
from furnace_trio.server.config import ServerConfig

from ..http_server import serve_app
from ..real_model import NAME, QUESTION, check_paris_streamed_and_not, default_model, default_runner
from .test_cuda_graphs import fresh_graphs

pytestmark = pytest.mark.gpu


def _cuda_runner(dtype: str, graphs: bool | None = None) -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(),
        RunnerConfig(device="cuda", dtype=dtype, kv_cache_bytes=256 << 20, cuda_graphs=graphs),
    )


def _prompt() -> tuple[int, ...]:
    tok = default_model().tokenizer
    text = tok.apply_chat_template(QUESTION)
    return tuple(tok.encode(text, add_special_tokens=False))


def test_cuda_float32_logits_match_the_cpu() -> None:
    """A whole prompt; the same prompt in two chunks (the second one masked, after 16
    cached tokens: the CUDA form with expanded keys); two prompts in one step."""
    ids = _prompt()
    plan = StepPlan((ChunkPlan(1, ids, 0, tuple(range(8))),))
    cpu = default_runner().logits(plan)
    cuda = _cuda_runner("float32")
    gpu = cuda.logits(plan)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-3, rtol=2e-3)

    table = tuple(range(8, 16))
    cuda.logits(StepPlan((ChunkPlan(2, ids[:16], 0, table),)))
    rest = cuda.logits(StepPlan((ChunkPlan(2, ids[16:], 16, table),)))
    torch.testing.assert_close(rest[-1:].cpu(), cpu[-1:], atol=2e-3, rtol=2e-3)

    # Two prefill rows in one step (one batched attention call on CUDA): the whole prompt,
    # and its first 20 tokens.
    both = StepPlan(
        (
            ChunkPlan(3, ids, 0, tuple(range(16, 24))),
            ChunkPlan(4, ids[:20], 0, tuple(range(24, 32))),
        )
    )
    short = default_runner().logits(StepPlan((ChunkPlan(5, ids[:20], 0, tuple(range(8))),)))
    got = cuda.logits(both).cpu()
    torch.testing.assert_close(got, torch.cat([cpu, short]), atol=2e-3, rtol=2e-3)


def test_cuda_prompt_scores_match_the_cpu() -> None:
    """A scored prompt in two chunks on CUDA (with decode graphs on, which a scoring step
    must not take): the logprob of each prompt token after the first, as the CPU's float32
    logits give it."""
    ids = _prompt()
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    table = tuple(range(8))
    cpu = torch.log_softmax(default_runner().prompt_logits(ids), dim=-1)
    cuda = _cuda_runner("float32", graphs=True)
    cuda.step(StepPlan((ChunkPlan(1, ids[:20], 0, table, score_ids=ids[1:21], score_top=1),)))
    last = ChunkPlan(
        1, ids[20:], 20, table, (SampleSpec(1, scored, ids, ()),), ids[21:], score_top=1
    )
    (token,) = cuda.step(StepPlan((last,)))
    assert token.prompt_logprobs is not None
    got = torch.tensor([s.logprob for s in token.prompt_logprobs])
    want = cpu[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def _greedy_answer(runner: ModelRunner, steps: int = 40) -> list[int]:
    """The runner's greedy answer to the Paris question, one step at a time."""
    tok = default_model().tokenizer
    ids = _prompt()
    table = tuple(range(8))
    greedy = SamplingParams(temperature=0, max_tokens=steps)
    out: list[int] = []
    chunk = ChunkPlan(1, ids, 0, table, (SampleSpec(1, greedy),))
    for _ in range(steps):
        (sampled,) = runner.step(StepPlan((chunk,)))
        if sampled.token_id in tok.eos_token_ids:
            break
        out.append(sampled.token_id)
        chunk = ChunkPlan(
            1, (sampled.token_id,), len(ids) + len(out) - 1, table, (SampleSpec(1, greedy),)
        )
    return out


def test_cuda_bfloat16_greedy_answer_says_paris() -> None:
    runner = _cuda_runner("bfloat16")
    assert "Paris" in default_model().tokenizer.decode(_greedy_answer(runner))
    # The decodes were graph replays (a runner on CUDA captures them by default).
    assert runner.graphs is not None and runner.graphs.captured == ((1, 256),)


def test_a_failed_capture_on_cuda_leaves_the_runner_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step that cannot be captured (here: it reads a value back to the host mid-capture)
    turns the graphs off; the decodes then run op by op, as without graphs, and the device
    is left healthy: a later runner captures and replays as usual."""
    replayed = _greedy_answer(_cuda_runner("bfloat16"))
    eager = _greedy_answer(_cuda_runner("bfloat16", graphs=False))
    forward = Transformer.forward

    def syncs_while_capturing(self: Transformer, *args: object) -> torch.Tensor:
        out = forward(self, *args)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()  # a host sync: not allowed in a capture
        return out

    monkeypatch.setattr(Transformer, "forward", syncs_while_capturing)
    runner = _cuda_runner("bfloat16")
    with caplog.at_level(logging.WARNING, logger="furnace_trio.runtime.cuda_graphs"):
        assert _greedy_answer(runner) == eager
    assert runner.graphs is not None and not runner.graphs.enabled
    assert runner.graphs.captured == ()
    warned = [
        r.getMessage() for r in caplog.records if r.name == "furnace_trio.runtime.cuda_graphs"
    ]
    assert len(warned) == 1 and warned[0].startswith("decode graphs off"), warned

    monkeypatch.undo()
    later = _cuda_runner("bfloat16")
    assert _greedy_answer(later) == replayed
    assert "Paris" in default_model().tokenizer.decode(replayed)
    assert later.graphs is not None and later.graphs.captured == ((1, 256),)


def test_cuda_steps_never_use_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's attention builds a plan for every new shape (about 60 ms on an H200): no
    attention call of a step, eager or captured, may take it; the process's own setting
    is back once the step is done."""
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for graphs in (True, False):
        answer = _greedy_answer(_cuda_runner("bfloat16", graphs=graphs), steps=6)
        assert len(answer) == 6
    layers = default_model().config.num_layers
    # Prefill and capture (with its warm-up run) with graphs; prefill and 5 decodes without.
    assert len(seen) == layers * (3 + 6), len(seen)
    assert not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


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
