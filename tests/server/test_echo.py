"""``echo`` on ``/v1/completions`` over a real socket with the ``openai`` client.

The scripted runner scores a prompt token ``t`` as ``-t / 100`` with alternatives ``t``,
``t + 1``, ... (``scripted.prompt_score``), so every scored position is checkable: an
off-by-one between positions and the tokens they predict, a lost score or a score on the
wrong choice fails.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import openai

from .. import scripted
from ..http_server import MODEL_NAME, Served, serve_scripted

PROMPT = [72, 105, 33, 32, 87, 104, 111]  # "Hi! Who"


def answer(prompt: tuple[int, ...], index: int) -> str:
    return f"<{len(prompt)}.{index}>"


def script(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*scripted.encode(answer(prompt, index)), scripted.EOS]


def client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def piece(token_id: int) -> str:
    return scripted.decode([token_id])


async def test_echo_puts_each_prompt_before_its_choices() -> None:
    prompts = ["Hello", "Goodbye, all"]
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        ids = [served.state.serving_backend().tokenizer.encode(p) for p in prompts]
        result = await c.completions.create(
            model=MODEL_NAME, prompt=prompts, n=2, max_tokens=20, echo=True
        )
        await served.wait_idle()
    expected = [prompts[i] + answer(tuple(ids[i]), j) for i in range(2) for j in range(2)]
    assert [choice.text for choice in result.choices] == expected
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(len(answer(tuple(p), 0)) for p in ids) * 2


async def test_echo_with_logprobs_scores_the_prompt_tokens() -> None:
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        result = await c.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=20, echo=True, logprobs=2
        )
        await served.wait_idle()
    (choice,) = result.choices
    generated = answer(tuple(PROMPT), 0)
    assert choice.text == "Hi! Who" + generated
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens == [piece(t) for t in PROMPT] + list(generated)
    assert logprobs.token_logprobs[: len(PROMPT)] == [None] + [-t / 100 for t in PROMPT[1:]]
    assert logprobs.token_logprobs[len(PROMPT) :] == [-0.5] * len(generated)
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    for t, top in zip(PROMPT[1:], logprobs.top_logprobs[1 : len(PROMPT)], strict=True):
        assert top == {piece(t): -t / 100, piece(t + 1): -t / 100 - 1}
    assert logprobs.text_offset == list(range(len(choice.text)))


async def test_every_sample_of_a_scored_prompt_carries_its_scores() -> None:
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        result = await c.completions.create(
            model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=20, echo=True, logprobs=0
        )
        await served.wait_idle()
    prompt_part = [None] + [-t / 100 for t in PROMPT[1:]]
    for j, choice in enumerate(result.choices):
        assert choice.index == j and choice.text == "Hi! Who" + answer(tuple(PROMPT), j)
        values = choice.logprobs.token_logprobs  # type: ignore[union-attr]
        assert values is not None and values[: len(PROMPT)] == prompt_part
        assert len(values) == len(PROMPT) + len(answer(tuple(PROMPT), j))


async def test_a_scored_prompt_is_computed_whole_without_the_prefix_cache() -> None:
    prompt = list(range(65, 91))  # 26 tokens: full blocks the cache keeps
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        plain = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        scored = await c.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=0
        )
        await served.wait_idle()
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (plain, scored)]  # type: ignore[union-attr]
    assert cached[0] > 0 and cached[1] == 0
    lps = scored.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None
    assert lps.token_logprobs[: len(prompt)] == [None] + [-t / 100 for t in prompt[1:]]


@dataclass
class Streamed:
    """One choice as its chunks came: the first chunk's text, then everything joined."""

    first: str = ""
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)


async def whole_and_streamed(
    c: openai.AsyncOpenAI, **kwargs: Any
) -> tuple[Any, dict[int, Streamed]]:
    """The same completions request, answered whole and streamed."""
    whole = await c.completions.create(**kwargs)
    streamed: dict[int, Streamed] = defaultdict(Streamed)
    async for chunk in await c.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            got = streamed[choice.index]
            if not got.text:
                got.first = choice.text
            got.text += choice.text
            if choice.logprobs is not None:
                got.tokens += choice.logprobs.tokens or []
                got.values += choice.logprobs.token_logprobs or []
            if choice.finish_reason is not None:
                got.ends.append(choice.finish_reason)
    return whole, streamed


async def test_echo_streams_the_prompt_first_with_its_scores() -> None:
    prompts = [PROMPT, PROMPT[:3]]
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        whole, streamed = await whole_and_streamed(
            c, model=MODEL_NAME, prompt=prompts, max_tokens=20, echo=True, logprobs=1
        )
        await served.wait_idle()
    for choice in whole.choices:
        got = streamed[choice.index]
        assert got.first.startswith(scripted.decode(prompts[choice.index]))
        assert choice.logprobs is not None
        assert got.text == choice.text
        assert got.tokens == choice.logprobs.tokens
        assert got.values == choice.logprobs.token_logprobs


async def test_a_prompt_answered_by_eos_at_once_is_still_echoed_and_scored() -> None:
    runner = scripted.ScriptedRunner(lambda prompt, i: [scripted.EOS])
    async with serve_scripted(runner) as served, client(served) as c:
        plain = await c.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True)
        scored = await c.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1)
        await served.wait_idle()
    assert plain.choices[0].text == scored.choices[0].text == "Hi! Who"
    assert plain.choices[0].finish_reason == scored.choices[0].finish_reason == "stop"
    lps = scored.choices[0].logprobs
    assert lps is not None
    assert lps.token_logprobs == [None] + [-t / 100 for t in PROMPT[1:]]


async def test_scoring_as_an_evaluation_harness_does() -> None:
    """lm-evaluation-harness's loglikelihood request: a batch of token prompts (context +
    continuation), max_tokens 1, logprobs 1, echo; it sums token_logprobs[ctxlen:-1] and
    checks each against the top alternative's."""
    context = [84, 104, 101, 32]  # "The "
    continuations = [[99, 97, 116], [100, 111, 103, 115]]  # "cat", "dogs"
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        result = await c.completions.create(
            model=MODEL_NAME,
            prompt=[context + rest for rest in continuations],
            max_tokens=1,
            logprobs=1,
            echo=True,
            temperature=0,
            seed=1234,
        )
        await served.wait_idle()
    choices = sorted(result.choices, key=lambda choice: choice.index)
    for choice, rest in zip(choices, continuations, strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        scored = choice.logprobs.token_logprobs[len(context) : -1]
        assert scored == [-t / 100 for t in rest]
        tops = (choice.logprobs.top_logprobs or [])[len(context) : -1]
        assert all(lp == max(top.values()) for lp, top in zip(scored, tops, strict=True))


async def test_max_tokens_0_echoes_the_prompt_alone_scored() -> None:
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        whole, streamed = await whole_and_streamed(
            c, model=MODEL_NAME, prompt=[PROMPT, PROMPT[:2]], max_tokens=0, echo=True, logprobs=1
        )
        unscored = await c.completions.create(
            model=MODEL_NAME, prompt="Say hi", max_tokens=0, echo=True
        )
        await served.wait_idle()
    for choice, prompt in zip(whole.choices, (PROMPT, PROMPT[:2]), strict=True):
        assert choice.text == streamed[choice.index].text == scripted.decode(prompt)
        assert choice.finish_reason == "length" and streamed[choice.index].ends == ["length"]
        lps = choice.logprobs
        assert lps is not None
        assert lps.token_logprobs == [None] + [-t / 100 for t in prompt[1:]]
        assert lps.tokens == [piece(t) for t in prompt]
    assert whole.usage is not None and whole.usage.completion_tokens == 0
    assert whole.usage.prompt_tokens == len(PROMPT) + 2
    assert unscored.choices[0].text == "Say hi" and unscored.choices[0].logprobs is None


async def test_max_tokens_0_without_echo_is_a_400() -> None:
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        try:
            await c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
        except openai.BadRequestError as exc:
            assert exc.param == "max_tokens" and "echo" in exc.message
        else:
            raise AssertionError("max_tokens 0 without echo was accepted")
        assert served.runner.plans == []
