"""Speculative decoding in the engine, over the scripted runner: the tokens, ends, KV and
streams of a speculating engine are those of one that does not speculate."""

from __future__ import annotations

import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken
from furnace_trio.engine import EngineConfig, GenerationRequest
from furnace_trio.engine.sequence import Seq, new_group
from furnace_trio.engine.speculation import SpeculationConfig, Speculator

from ..scripted import EOS, FILLER, ScriptedRunner, encode
from .harness import Outcome, collect, collect_all, request, serving

SPEC = EngineConfig(speculation=SpeculationConfig(method="ngram"))
OFF = EngineConfig()

PARAGRAPH = (
    "def area(r):\n    return 3.14159 * r * r\n\ndef volume(r, h):\n    return area(r) * h\n"
)
EDITED = PARAGRAPH.replace("3.14159", "math.pi")
PROMPT = "Rename the constant:\n" + PARAGRAPH + "\nAnswer:\n"


def _script(text: str, *, end: bool = True) -> dict[tuple[int, ...], list[int]]:
    return {encode(PROMPT): [*encode(text), *([EOS] if end else [])]}


def _drafted(runner: ScriptedRunner) -> int:
    return sum(chunk.num_drafts for plan in runner.plans for chunk in plan.chunks)


async def _run(
    config: EngineConfig,
    script: object,
    *requests: GenerationRequest,
) -> tuple[list[Outcome], ScriptedRunner]:
    runner = ScriptedRunner(script, block_size=4)  # type: ignore[arg-type]
    async with serving(runner, config) as engine:
        outs = await collect_all([engine.submit(r) for r in requests])
        stats = await engine.wait_statistics(lambda s: s.idle)
        assert stats.leaks() == []
    return outs, runner


async def _both(
    script: object, make: object
) -> tuple[list[Outcome], list[Outcome], ScriptedRunner]:
    off, _ = await _run(OFF, script, *make())  # type: ignore[operator]
    on, runner = await _run(SPEC, script, *make())  # type: ignore[operator]
    return off, on, runner


def _same(off: list[Outcome], on: list[Outcome]) -> None:
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert {i: (f.reason, f.completion_tokens) for i, f in a.finished.items()} == {
            i: (f.reason, f.completion_tokens) for i, f in b.finished.items()
        }
        assert a.failed is None and b.failed is None


async def test_an_edit_is_drafted_from_the_prompt_and_comes_out_the_same() -> None:
    off, on, runner = await _both(
        _script(EDITED), lambda: [request(PROMPT, max_tokens=200, temperature=0)]
    )
    _same(off, on)
    assert on[0].text[0] == EDITED
    drafted = _drafted(runner)
    assert drafted > 0
    # fewer steps than tokens: several tokens per step
    assert len(runner.plans) < len(EDITED) * 2 // 3
    finished = on[0].finished[0]
    assert finished.drafted_tokens == drafted
    assert 0 < finished.accepted_tokens <= drafted


async def test_rejected_drafts_leave_nothing_in_the_prefix_cache() -> None:
    """A reply that keeps leaving the prompt's text: the rejected drafts' KV is never
    reused. A second request whose prompt is the first one's prompt and reply reads its
    cached blocks, and the scripted runner checks every position it reads."""
    text = EDITED.replace("area", "surface").replace("r * r", "r ** 2")
    reply = [*encode(text)]
    follow = encode(PROMPT) + tuple(reply) + encode(" more")
    script = {encode(PROMPT): [*reply, EOS], follow: [*encode("ok"), EOS]}
    runner = ScriptedRunner(script, block_size=4)
    async with serving(runner, SPEC) as engine:
        first = await collect(engine.submit(request(PROMPT, max_tokens=200, temperature=0)))
        assert first.text[0] == text
        second = await collect(
            engine.submit(GenerationRequest(follow, SamplingParams(max_tokens=10, temperature=0)))
        )
        assert second.failed is None and second.text[0] == "ok"
        admitted = [e for e in second.events if type(e).__name__ == "Admitted"]
        assert admitted[0].cached_tokens > len(PROMPT)  # type: ignore[attr-defined]
        stats = await engine.wait_statistics(lambda s: s.idle)
        assert stats.leaks() == []
        assert stats.spec_drafted_tokens_total > stats.spec_accepted_tokens_total > 0


async def test_max_tokens_and_an_end_token_inside_the_drafts() -> None:
    off, on, _ = await _both(
        _script(EDITED), lambda: [request(PROMPT, max_tokens=37, temperature=0)]
    )
    _same(off, on)
    assert on[0].finished[0].reason == "length" and on[0].finished[0].completion_tokens == 37
    # The prompt holds the end token after the paragraph, so it is drafted and accepted.
    prompt = PROMPT + PARAGRAPH
    ids = (*encode(prompt[: -len(PARAGRAPH)]), *encode(PARAGRAPH), EOS, *encode("tail"))
    script = {ids: [*encode(PARAGRAPH), EOS]}

    def make() -> list[GenerationRequest]:
        return [GenerationRequest(ids, SamplingParams(max_tokens=300, temperature=0))]

    off, on, runner = await _both(script, make)
    _same(off, on)
    assert on[0].finished[0].reason == "stop" and on[0].text[0] == PARAGRAPH
    assert any(EOS in chunk.token_ids for plan in runner.plans for chunk in plan.chunks)


async def test_stop_strings_logprobs_and_n() -> None:
    def make() -> list[GenerationRequest]:
        return [
            request(PROMPT, max_tokens=200, temperature=0, stop=("volume",)),
            request(PROMPT, max_tokens=60, temperature=0, logprobs=2),
            request(PROMPT, max_tokens=60, temperature=0, n=2),
        ]

    off, on, runner = await _both(_script(EDITED), make)
    _same(off, on)
    assert on[0].text[0] == EDITED[: EDITED.index("volume")]
    logprobs = [e for e in on[1].events if type(e).__name__ == "Delta"]
    assert sum(len(e.logprobs) for e in logprobs) == 60  # type: ignore[attr-defined]
    assert on[2].text[0] == on[2].text[1] == EDITED[:60]
    assert _drafted(runner) > 0


async def test_under_load_nobody_drafts() -> None:
    config = EngineConfig(speculation=SpeculationConfig(method="ngram", max_batch=1))
    runner = ScriptedRunner(_script(EDITED), block_size=4)
    async with serving(runner, config) as engine:
        outs = await collect_all(
            [engine.submit(request(PROMPT, max_tokens=50, temperature=0)) for _ in range(3)]
        )
    assert all(out.text[0] == EDITED[:50] for out in outs)
    for plan in runner.plans:
        decoding = [c for c in plan.chunks if c.start_pos >= len(PROMPT)]
        if len(decoding) > 1:
            assert all(c.num_drafts == 0 for c in decoding)


async def test_seeded_sampling_does_not_speculate_and_grammars_do() -> None:
    class Everything:
        def allowed(self, seq_id: int, output_token_ids: object) -> None:
            return None

        def valid_drafts(self, seq_id: int, output_token_ids: object, drafts: object) -> int:
            return len(drafts)  # type: ignore[arg-type]

    runner = ScriptedRunner(_script(EDITED), block_size=4)
    async with serving(runner, SPEC) as engine:
        out = await collect(engine.submit(request(PROMPT, max_tokens=40, temperature=1.0, seed=7)))
    assert out.text[0] == EDITED[:40] and _drafted(runner) == 0
    runner = ScriptedRunner(_script(EDITED), block_size=4)
    async with serving(runner, SPEC) as engine:
        grammar = request(PROMPT, max_tokens=40, temperature=0, constraint=Everything())
        out = await collect(engine.submit(grammar))
    assert out.text[0] == EDITED[:40] and _drafted(runner) > 0
    runner = ScriptedRunner(_script(EDITED), block_size=4)
    async with serving(runner, SPEC) as engine:
        out = await collect(engine.submit(request(PROMPT, max_tokens=40, temperature=1.0)))
    assert out.text[0] == EDITED[:40] and _drafted(runner) > 0


async def test_a_session_turn_pins_only_what_it_computed() -> None:
    messages = [{"role": "user", "content": "x"}]
    runner = ScriptedRunner(_script(EDITED), block_size=4)
    async with serving(runner, SPEC) as engine:
        turn = engine.begin_turn("s1", "owner", messages)
        out = await collect(
            engine.submit(
                GenerationRequest(
                    encode(PROMPT), SamplingParams(max_tokens=200, temperature=0), turn=turn
                )
            )
        )
        assert out.text[0] == EDITED
        session = engine.get_session("s1", "owner")
        engine.end_turn(turn)
        stats = await engine.wait_statistics(lambda s: s.idle)
        assert stats.leaks() == []
    tokens = (*encode(PROMPT), *encode(EDITED))
    assert session.blocks and len(session.token_ids) == 4 * len(session.blocks)
    assert session.token_ids == tokens[: len(session.token_ids)]
    for i, block in enumerate(session.blocks):  # the pinned KV holds exactly those tokens
        assert tuple(runner.kv[block]) == session.token_ids[4 * i : 4 * i + 4]


async def test_cancelling_while_speculating_frees_everything() -> None:
    gate = trio.Event()
    runner = ScriptedRunner(_script(EDITED), block_size=4, sleep=0)
    async with serving(runner, SPEC) as engine:
        stream = engine.submit(request(PROMPT, max_tokens=200, temperature=0))
        async with stream:
            async for _event in stream:
                if _drafted(runner) and len(runner.plans) > 5:
                    break
        gate.set()
        stats = await engine.wait_statistics(lambda s: s.idle)
        assert stats.leaks() == []
        assert stats.requests["aborted"] == 1


async def test_a_draft_models_proposals_are_verified_and_leave_nothing_behind() -> None:
    """``draft``: the engine plans placeholder drafts, the runner's draft model replaces
    them (here: the script's tokens, with every fourth one wrong). The output is plain
    decoding's; the scripted runner reads every context back through the block tables, so
    a placeholder or rejected draft left in the KV or the prefix cache would fail a step
    (the second request reuses the first one's cached blocks)."""
    script = _script(EDITED)
    right = script[encode(PROMPT)]

    def drafter(context: tuple[int, ...], k: int) -> list[int]:
        done = len(context) - len(encode(PROMPT))
        tokens = [*right, *[FILLER] * k][done : done + k]
        return [t + 1 if (done + i) % 4 == 3 else t for i, t in enumerate(tokens)]

    def make() -> list[GenerationRequest]:
        return [request(PROMPT, max_tokens=200, temperature=0)]

    off, _ = await _run(OFF, script, *make(), *make())
    runner = ScriptedRunner(script, block_size=4)
    runner.drafter = drafter
    config = EngineConfig(speculation=SpeculationConfig(method="draft"))
    async with serving(runner, config) as engine:
        first = await collect(engine.submit(make()[0]))
        second_out = await collect(engine.submit(make()[0]))
        stats = await engine.wait_statistics(lambda s: s.idle)
        assert stats.leaks() == []
    _same(off, [first, second_out])
    placeholders = [c for p in runner.plans for c in p.chunks if c.num_drafts]
    assert placeholders
    # the engine's drafts are placeholders: the last token repeated
    assert all(len(set(c.token_ids)) == 1 for c in placeholders)
    finished = first.finished[0]
    assert 0 < finished.accepted_tokens < finished.drafted_tokens
    assert stats.prefix_cache_hits_total > 0


def test_answers_reject_tokens_that_were_not_drafted() -> None:
    from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
    from furnace_trio.engine.speculation import answers

    spec = SampleSpec(0, SamplingParams())
    plan = StepPlan((ChunkPlan(0, (1, 2, 3), 5, (0, 1), (spec,), num_drafts=2),))
    assert len(answers(plan, [SampledToken(0, 2), SampledToken(0, 9)])[0]) == 2
    for bad in (
        [SampledToken(0, 5), SampledToken(0, 9)],  # 5 was not the draft
        [SampledToken(0, 2), SampledToken(0, 3), SampledToken(0, 4), SampledToken(0, 4)],
        [],
    ):
        try:
            answers(plan, bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
    # a runner that proposed the drafts itself: checked against its proposals
    own = SampledToken(0, 7, proposed=(7, 8))
    assert len(answers(plan, [own, SampledToken(0, 8), SampledToken(0, 1)])[0]) == 3
    for bad in (
        [SampledToken(0, 7, proposed=(7,))],  # one proposal for two drafts
        [SampledToken(0, 7, proposed=(6, 8)), SampledToken(0, 1)],  # 7 was not proposed
    ):
        try:
            answers(plan, bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def _seq(tokens: tuple[int, ...], prompt_len: int, **params: object) -> Seq:
    group = new_group("r", tokens[:prompt_len], SamplingParams(**params), 1, (), 0)  # type: ignore[arg-type]
    seq = group.samples[0]
    seq.token_ids = list(tokens)
    return seq


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    speculator = Speculator(SpeculationConfig(method="ngram", first_drafts=3))
    seq = _seq((1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 0, 2, 3), 10, max_tokens=100)
    # "2 3" last followed by "6 7 0" (the latest occurrence wins)
    assert speculator.propose(seq, 10) == (6, 7, 0)
    assert speculator.propose(seq, 2) == (6, 7)
    seq.token_ids.append(42)  # nothing before ends in "3 42"
    assert speculator.propose(seq, 10) == ()


def test_draft_length_doubles_shrinks_and_sits_out() -> None:
    speculator = Speculator(SpeculationConfig(method="ngram", max_drafts=8, first_drafts=2))
    seq = _seq((*range(1, 40), 1, 2), 39, max_tokens=100)
    assert len(speculator.propose(seq, 99)) == 2
    speculator.record(seq, 2, 2)
    assert len(speculator.propose(seq, 99)) == 4
    speculator.record(seq, 4, 4)
    speculator.record(seq, 8, 8)
    assert len(speculator.propose(seq, 99)) == 8  # capped
    speculator.record(seq, 8, 3)
    assert len(speculator.propose(seq, 99)) == 4  # what held, plus one
    speculator.record(seq, 4, 0)
    assert speculator.propose(seq, 99) == ()  # sits out one step
    assert len(speculator.propose(seq, 99)) == 2
    speculator.record(seq, 2, 0)
    assert speculator.propose(seq, 99) == speculator.propose(seq, 99) == ()  # then two


def test_a_step_holds_at_most_max_drafts_and_none_under_load() -> None:
    config = SpeculationConfig(method="ngram", max_drafts=6, first_drafts=4, max_batch=2)
    seqs = [_seq((*range(1, 40), 1, 2), 39, max_tokens=100) for _ in range(3)]
    for i, seq in enumerate(seqs):
        seq.seq_id = i
    drafts = Speculator(config).propose_all(seqs[:2], 100)
    assert sum(map(len, drafts.values())) == 6
    assert Speculator(config).propose_all(seqs, 100) == {}
    # never past max_tokens: 5 outputs of 8 leave room for 2 drafts and the last token
    seq = _seq((*range(1, 40), 1, 2, 3, 4, 5), 39, max_tokens=7)
    assert len(Speculator(config).propose(seq, 7 - seq.num_output_tokens - 1)) == 1
