"""Time to first token per turn of a growing chat: full-history resends vs sessions.

Not a test. Serves the default model on a loopback socket (hypercorn, in process) and
runs ``--conversations`` conversations at once, each ``--turns`` turns of about
``--words`` new words (~200 tokens) per user message, twice: first resending the whole
history every turn (the prefix cache does the reuse), then as sessions (only the new
message is sent). Greedy, ``--max-tokens`` per reply. Prints a Markdown table.

    python benchmarks/bench_sessions.py [--turns 8] [--conversations 2]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from functools import partial
from typing import Any

import httpx
import hypercorn.trio
import openai
import trio
from hypercorn.config import Config

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig

logger = logging.getLogger("bench_sessions")
MODEL: list[str] = ["SmolLM2-135M-Instruct"]  # replaced by what /v1/models says

WORDS = [
    "river",
    "mountain",
    "quiet",
    "lantern",
    "harbor",
    "orchard",
    "silver",
    "morning",
    "garden",
    "window",
    "letter",
    "journey",
    "winter",
    "candle",
    "meadow",
    "thunder",
    "bridge",
    "forest",
    "village",
    "market",
    "season",
    "ocean",
    "castle",
    "painter",
    "music",
    "whisper",
    "shadow",
    "feather",
    "stone",
    "valley",
]


def user_message(rng: random.Random, turn: int, words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Turn {turn}. Here are my notes: {body}. Summarize them in one sentence."


async def ttft(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], **kw: Any
) -> tuple[float, str, int]:
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    cached = 0
    stream = await client.chat.completions.create(
        model=MODEL[0],
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - started), "".join(parts), cached


async def conversation(
    url: str, mode: str, index: int, args: argparse.Namespace, out: list[list[float]]
) -> None:
    rng = random.Random(index)
    history: list[dict[str, str]] = []
    sid = f"bench-{mode}-{index}-{time.monotonic_ns()}"
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0) as c:
        for turn in range(args.turns):
            message = {"role": "user", "content": user_message(rng, turn, args.words)}
            params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0}
            if mode == "resend":
                seconds, reply, cached = await ttft(c, [*history, message], **params)
            else:
                seconds, reply, cached = await ttft(
                    c, [message], extra_body={"session_id": sid}, **params
                )
            history += [message, {"role": "assistant", "content": reply}]
            out[turn].append(seconds)
            logger.info(
                "%s conv %d turn %d: ttft %.3fs cached %d", mode, index, turn + 1, seconds, cached
            )


async def main(args: argparse.Namespace) -> None:
    app = create_app(ServerConfig(device="cpu", max_running=4))
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.startup_timeout = 600
    shutdown = trio.Event()
    results: dict[str, list[list[float]]] = {}
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hypercorn.trio.serve, app, config, shutdown_trigger=shutdown.wait)
        )
        url = binds[0]
        async with httpx.AsyncClient() as h:  # warm up (first-call overheads)
            MODEL[0] = (await h.get(url + "/v1/models")).json()["data"][0]["id"]
            await h.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
        for mode in ("resend", "session"):
            per_turn: list[list[float]] = [[] for _ in range(args.turns)]
            async with trio.open_nursery() as convs:
                for i in range(args.conversations):
                    convs.start_soon(conversation, url, mode, i, args, per_turn)
            results[mode] = per_turn
        shutdown.set()
    print("| turn | resend TTFT (s) | session TTFT (s) |")
    print("| ---: | ---: | ---: |")
    for t in range(args.turns):
        r = statistics.mean(results["resend"][t])
        s = statistics.mean(results["session"][t])
        print(f"| {t + 1} | {r:.3f} | {s:.3f} |")
    for mode in ("resend", "session"):
        first = statistics.mean(results[mode][0])
        last = statistics.mean(results[mode][-1])
        print(f"{mode}: turn {args.turns} / turn 1 = {last / first:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=24)
    logging.basicConfig(level=logging.WARNING)
    logger.setLevel(logging.INFO)
    trio.run(main, parser.parse_args())
