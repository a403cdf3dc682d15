"""Cost of grammar-constrained decoding (llguidance) on the default model.

1. Mask time per token: a JSON-schema constraint walked along a valid answer, token by
   token, timing :meth:`GrammarConstraint.allowed` (what the sampler calls per token).
2. Sharing steps: 16 concurrent greedy requests at engine level, none constrained vs half
   constrained by a JSON schema, aggregate tok/s in the same run (a ratio).

Run: ``python benchmarks/bench_grammar.py`` (about a minute).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent))

from _common import PROMPTS, chat_ids

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, Engine, EngineConfig, GenerationRequest
from furnace_trio.loading.loader import load_model
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.tools.grammar import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "population", "landmarks"],
}
ANSWER = {"city": "Paris", "population": 2102650, "landmarks": ["Eiffel Tower", "Louvre"]}


def mask_times(compiler: GrammarCompiler, tokenizer) -> list[float]:  # type: ignore[no-untyped-def]
    constraint = compiler.json_schema(SCHEMA)
    ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    times = []
    for i in range(len(ids) + 1):
        started = time.perf_counter()
        mask = constraint.allowed(0, ids[:i])
        times.append(time.perf_counter() - started)
        assert mask is not None, "the answer left the grammar"
    return times


async def aggregate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> float:
    tokens = 0

    async def one(ids: list[int], p: SamplingParams) -> None:
        nonlocal tokens
        async with engine.submit(GenerationRequest(tuple(ids), p)) as stream:
            async for event in stream:
                if isinstance(event, Delta):
                    tokens += len(event.token_ids)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for ids, p in zip(prompts, params, strict=True):
            nursery.start_soon(one, ids, p)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    loaded = load_model(None)
    tok = loaded.tokenizer
    compiler = GrammarCompiler(tok)
    started = time.perf_counter()
    compiler.json_schema(SCHEMA)
    print(
        f"first constraint (builds the llguidance tokenizer): {time.perf_counter() - started:.2f} s"
    )
    times = sorted(mask_times(compiler, tok)[1:])  # the first mask pays for setup
    print(
        f"mask per token over {len(times)} tokens: median {statistics.median(times) * 1e6:.0f} us, "
        f"p95 {times[int(0.95 * (len(times) - 1))] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us"
    )

    runner = ModelRunner.from_loaded(loaded, RunnerConfig(device="cpu", kv_cache_bytes=256 << 20))
    prompts = [chat_ids(loaded, p + " Answer in JSON.") for p in PROMPTS[:16]]
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    async def run() -> None:
        engine = Engine(
            runner, decode=tok.decode, eos_token_ids=tok.eos_token_ids, config=EngineConfig()
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await aggregate(engine, prompts[:2], [plain, plain])  # warm up
            base = await aggregate(engine, prompts, [plain] * 16)
            mixed_params = [
                dataclasses.replace(plain, constraint=compiler.json_schema(SCHEMA))
                if i % 2
                else plain
                for i in range(16)
            ]
            mixed = await aggregate(engine, prompts, mixed_params)
            print(f"16 streams, none constrained: {base:.1f} tok/s")
            print(f"16 streams, 8 constrained:    {mixed:.1f} tok/s ({mixed / base:.2f}x)")
            engine.shutdown()
            nursery.cancel_scope.cancel()

    trio.run(run)


if __name__ == "__main__":
    main()
