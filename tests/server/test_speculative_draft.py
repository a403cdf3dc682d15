"""``FURNACE_SPECULATIVE=draft:<path>`` over the socket with the official client, the
default model drafting for itself: greedy answers (streamed and not, with stop strings,
``max_tokens``, logprobs and ``n > 1``) are those of a server that does not speculate, a
stream cancelled while drafting leaves the server answering as before, a draft model
with another vocabulary is refused at startup with both models named, and a Hugging Face
directory of another architecture with the same tokenizer drafts."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, GenerationRequest
from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.server.app import create_app
from furnace_trio.server.backend import Backend, load_backend
from furnace_trio.server.config import ServerConfig

from .._model_fixtures import write_tiny_model
from ..http_server import serve_app
from ..real_model import default_model
from .test_speculative import EDIT, _answers, spec_counts

pytestmark = pytest.mark.model


def _draft_config(**fields: object) -> ServerConfig:
    return ServerConfig(
        device="cpu", kv_cache_mb=32, speculative=f"draft:{default_model_path()}", **fields
    )  # type: ignore[arg-type]


async def test_a_drafting_server_answers_as_one_that_does_not() -> None:
    default_model()  # skips without the default model
    plain, plain_stream, _ = await _answers(ServerConfig(device="cpu", kv_cache_mb=32))
    spec, spec_stream, metrics = await _answers(_draft_config())
    assert spec == plain
    assert "".join(spec_stream) == "".join(plain_stream) == plain[0][0][0]
    counts = spec_counts(metrics)
    drafted = counts["furnace_spec_drafted_tokens_total"]
    assert drafted > 0
    # the model drafting for itself: its drafts miss only past the ends of the answers
    assert counts["furnace_spec_accepted_tokens_total"] > 0.5 * drafted


async def test_cancelling_a_drafting_stream() -> None:
    default_model()
    app = create_app(_draft_config())
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        model = (await client.models.list()).data[0].id
        body = {"model": model, "messages": EDIT, "temperature": 0, "max_tokens": 200}
        whole = await client.chat.completions.create(**body)  # type: ignore[call-overload]
        for _ in range(2):
            stream = await client.chat.completions.create(stream=True, **body)  # type: ignore[call-overload]
            pieces = 0
            async for chunk in stream:
                pieces += bool(chunk.choices and chunk.choices[0].delta.content)
                if pieces == 5:
                    break
            await stream.close()
        again = await client.chat.completions.create(**body)  # type: ignore[call-overload]
        assert again.choices[0].message.content == whole.choices[0].message.content
        metrics = (await http.get("/metrics")).text
    assert 'furnace_requests_total{outcome="aborted"} 2' in metrics.splitlines()


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    default_model()
    tiny = write_tiny_model(tmp_path, "llama", tied=True)
    config = ServerConfig(device="cpu", kv_cache_mb=8, speculative=f"draft:{tiny}")
    with pytest.raises(UnsupportedModelError) as refused:
        load_backend(config)
    message = str(refused.value)
    assert "tiny-llama-tied" in message and "SmolLM2-135M-Instruct" in message
    assert "vocabular" in message


async def _greedy(backend: Backend, prompts: list[tuple[int, ...]]) -> tuple[list[list[int]], int]:
    """Each prompt's 24 greedy tokens from the backend's engine, all at once; the drafts."""
    engine = backend.engine
    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        async with engine.submit(GenerationRequest(prompts[i], params)) as stream:
            async for event in stream:
                if isinstance(event, Delta):
                    tokens[i].extend(event.token_ids)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as requests:
            for i in range(len(prompts)):
                requests.start_soon(one, i)
        drafted = engine.statistics().spec_drafted_tokens_total
        engine.shutdown()
    return tokens, drafted


async def test_a_hugging_face_draft_of_another_architecture(tmp_path: Path) -> None:
    """A tiny Llama served with a tiny Qwen2 of the same tokenizer drafting (Hugging Face
    directories, random weights): the draft loads, drafts, and the greedy tokens are those
    of the Llama alone."""
    served = write_tiny_model(tmp_path, "llama", tied=False)
    draft = write_tiny_model(tmp_path, "qwen2", tied=True)
    prompts = [(5, 6, 7, 8, 9, 10), (40, 41, 42)]
    results = []
    for speculative in ("off", f"draft:{draft}"):
        config = ServerConfig(
            model=str(served), device="cpu", kv_cache_mb=4, speculative=speculative
        )
        backend = await trio.to_thread.run_sync(load_backend, config)
        results.append(await _greedy(backend, prompts))
    (plain, _), (drafting, drafted) = results
    assert drafting == plain
    assert all(len(t) == 24 for t in plain)
    assert drafted > 0
