"""Speculative decoding (``FURNACE_SPECULATIVE``): tokens per second with it off and on.

Workloads, greedy, natural ends (no ``ignore_eos``), on the default model with the
server's engine settings (:func:`~furnace_trio.server.backend.build_engine`):

- **edit**: "return this paragraph with one change" chat requests, one after another on
  one stream, and the same at 16 concurrent streams;
- **chat**: the benchmark chat prompts, one stream, and at 16 concurrent streams;
- **json**: "list these people as JSON" under a JSON schema (an array of objects with the
  same keys: JSON that repeats keys), one stream, each request with its own grammar.

Each round runs every workload with speculation off and then on, on a fresh engine over
one runner (so the prefix cache starts empty for both), and the rounds repeat: A/B
interleaved in one process, so the ratios hold on a shared machine where absolute figures
do not. The greedy texts of off and on are compared (they must be identical).

``--draft PATH`` adds ``draft:PATH`` (a draft model with the default model's tokenizer;
``default``: the default model drafting for itself, which accepts nearly every draft and
so shows what drafting with a model costs); ``--methods`` picks the methods compared with
``off``.

    python benchmarks/bench_speculative.py [--rounds 3] [--quick] [--draft PATH|default]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio
from _common import PROMPTS, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tools.test_grammar import PERSON

from furnace_trio.core.params import SamplingParams, TokenConstraint
from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine import Delta, Engine, GenerationRequest
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.runtime.draft import Drafter
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.backend import build_engine, load_draft
from furnace_trio.server.config import ServerConfig
from furnace_trio.tools.grammar import GrammarCompiler

PARAGRAPHS = (
    (
        "The museum opens at nine in the morning and closes at six in the evening. Visitors "
        "can buy tickets at the entrance or online, and children under twelve enter for free. "
        "Guided tours leave every hour from the main hall, and the cafe on the second floor "
        "serves lunch until three.",
        "'nine' to 'ten'",
    ),
    (
        "Our team meets every Monday to plan the week. Each person shares what they finished, "
        "what they are working on, and anything that blocks them. The meeting lasts thirty "
        "minutes, and notes are posted in the shared folder by noon.",
        "'Monday' to 'Tuesday'",
    ),
    (
        "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the "
        "dough for ten minutes, then let it rise for two hours in a warm place. Shape the loaf, "
        "let it rise again, and bake it for forty minutes until the crust is golden.",
        "'forty' to 'forty-five'",
    ),
    (
        "The library lends books for three weeks. Members can renew a book twice online unless "
        "another member has reserved it. Late returns cost ten cents a day, and lost books must "
        "be replaced or paid for at the front desk.",
        "'three weeks' to 'two weeks'",
    ),
)


def edit_messages() -> list[list[dict[str, str]]]:
    """The edit requests: a phrasing that the default model answers by copying the
    paragraph (other phrasings make it paraphrase)."""
    return [
        [
            {
                "role": "user",
                "content": f"Proofread this paragraph and return it with {change}. "
                f"Keep every other word the same.\n\n{p}",
            }
        ]
        for p, change in PARAGRAPHS
    ]


#: The json workload's schema: records that repeat their keys.
PEOPLE = {"type": "array", "items": PERSON}
PEOPLE_TEXTS = (
    "Ann is 7, Bob is 9, Cid is 11 and Dee is 13.",
    "Eve is 31, Fay is 28, Gus is 40, Hal is 52 and Ivy is 19.",
    "Jon is 64, Kim is 23 and Lee is 37.",
    "Max is 5, Ned is 8, Oda is 12, Pam is 15 and Rex is 3.",
)


def json_messages() -> list[list[dict[str, str]]]:
    """The json requests: a list of people to return under :data:`PEOPLE`."""
    return [
        [{"role": "user", "content": f"{t} List them as JSON with their name and age."}]
        for t in PEOPLE_TEXTS
    ]


def chat_messages() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in PROMPTS]


class TimedDrafter:
    """A drafter that adds up the time its proposals take (on the model thread)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.seconds = 0.0

    def fill(self, plan: StepPlan) -> StepPlan:
        start = time.perf_counter()
        try:
            return self.inner.fill(plan)
        finally:
            self.seconds += time.perf_counter() - start

    def release(self, seq_ids: Iterable[int]) -> None:
        self.inner.release(seq_ids)

    def observe(self, plan: StepPlan, tokens: Sequence[SampledToken]) -> None:
        self.inner.observe(plan, tokens)


@dataclass
class Run:
    tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    texts: dict[int, list[int]]
    draft_seconds: float = 0.0  # of ``seconds``, the draft model's proposals


def run_rounds(
    engines: Sequence[Engine], rounds: int, measure: Callable[[int], Awaitable[None]]
) -> None:
    """Start ``engines``, await ``measure(round)`` for each round, stop them (garbage
    collection frozen first, so that no collection lands inside a measurement)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for engine in engines:
                await nursery.start(engine.run)
            for r in range(rounds):
                await measure(r)
            for engine in engines:
                engine.shutdown()

    gc.collect()
    gc.freeze()
    trio.run(main)


async def run_workload(
    engine: Engine,
    prompts: list[tuple[int, ...]],
    streams: int,
    max_tokens: int,
    drafter: TimedDrafter | None = None,
    grammar: Callable[[], TokenConstraint] | None = None,
) -> Run:
    """Every prompt once, ``streams`` at a time (closed loop), greedy; ``grammar``: each
    request constrained by a fresh constraint from it (as the server makes one a request)."""
    texts: dict[int, list[int]] = {}
    queue = list(range(len(prompts)))

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            constraint = grammar() if grammar is not None else None
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
            out = texts.setdefault(i, [])
            async with engine.submit(GenerationRequest(prompts[i], params)) as stream:
                async for event in stream:
                    if isinstance(event, Delta):
                        out.extend(event.token_ids)

    before = engine.statistics()
    drafting = drafter.seconds if drafter is not None else 0.0
    start = time.perf_counter()
    async with trio.open_nursery() as workers:
        for _ in range(streams):
            workers.start_soon(worker)
    seconds = time.perf_counter() - start
    after = engine.statistics()
    return Run(
        sum(len(t) for t in texts.values()),
        seconds,
        after.steps_total - before.steps_total,
        after.spec_drafted_tokens_total - before.spec_drafted_tokens_total,
        after.spec_accepted_tokens_total - before.spec_accepted_tokens_total,
        texts,
        drafter.seconds - drafting if drafter is not None else 0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, fewer prompts")
    parser.add_argument("--tokens", type=int, default=16, help="FURNACE_SPECULATIVE_TOKENS")
    parser.add_argument("--only", default="", help="run the workloads whose name has this")
    parser.add_argument("--draft", help="also draft:PATH (`default`: the default model)")
    parser.add_argument(
        "--methods", help="methods besides off, comma-separated (default: ngram and draft)"
    )
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    methods = ["ngram", *(["draft"] if args.draft else [])]
    if args.methods:
        methods = args.methods.split(",")
    methods = ["off", *(m for m in methods if m != "off")]

    loaded: LoadedModel = load_model(None)
    settings = RunnerConfig(device="cpu", quantization="auto", kv_cache_bytes=256 << 20)
    tok = loaded.tokenizer
    draft_path = str(default_model_path()) if args.draft == "default" else args.draft
    # One engine per method, each with a runner (KV cache) and model thread of its own
    # (an engine's model thread ends with it), both alive for the whole run.
    engines: dict[str, Engine] = {}
    drafter: TimedDrafter | None = None
    for method in methods:
        thread = ModelThread()
        runner = thread.call(ModelRunner.from_loaded, loaded, settings)
        setting = method
        if method == "draft":
            setting = f"draft:{draft_path}"
            draft = thread.call(load_draft, runner, loaded, draft_path, settings)
            runner.drafter = drafter = TimedDrafter(draft)
        config = ServerConfig(speculative=setting, speculative_tokens=args.tokens)
        engines[method] = build_engine(runner, tok, config, "cpu", thread)

    def ids(messages: list[dict[str, str]]) -> tuple[int, ...]:
        return tuple(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))

    compiler = GrammarCompiler(tok)
    compiler.warm()

    def people_grammar() -> TokenConstraint:
        return compiler.json_schema(PEOPLE)

    edits = [ids(m) for m in edit_messages()]
    chats = [ids(m) for m in chat_messages()]
    if args.quick:
        chats = chats[:4]
    people = [ids(m) for m in json_messages()]
    workloads = {
        "edit, 1 stream": (edits, 1, 256),
        "chat, 1 stream": (chats[:8], 1, 128),
        "json, 1 stream": (people, 1, 160),
        "edit, 16 streams": (edits * 4, 16, 256),
        "chat, 16 streams": (chats[:16] if not args.quick else chats * 4, 16, 128),
    }
    workloads = {name: w for name, w in workloads.items() if args.only in name}
    totals: dict[tuple[str, str], list[Run]] = defaultdict(list)

    async def measure(r: int) -> None:
        for name, (prompts, streams, max_tokens) in workloads.items():
            for method, engine in engines.items():
                timed = drafter if method == "draft" else None
                grammar = people_grammar if name.startswith("json") else None
                run = await run_workload(engine, prompts, streams, max_tokens, timed, grammar)
                totals[(name, method)].append(run)
                print(
                    f"round {r + 1} {name} {method}: {run.tokens} tokens "
                    f"{run.tokens / run.seconds:.1f} tok/s, {run.steps} steps",
                    flush=True,
                )

    run_rounds(list(engines.values()), rounds, measure)
    print(f"\n{machine()}, {rounds} round(s) interleaved {'/'.join(methods)}\n")
    print(
        "| workload | method | off tok/s | on tok/s | ratio | tokens/step off -> on "
        "| accepted | same text |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in workloads:
        for method in methods[1:]:
            off, on = totals[(name, "off")], totals[(name, method)]
            rate = [sum(x.tokens for x in r) / sum(x.seconds for x in r) for r in (off, on)]
            per_step = [sum(x.tokens for x in r) / sum(x.steps for x in r) for r in (off, on)]
            drafted = sum(x.drafted for x in on)
            accepted = sum(x.accepted for x in on)
            same = all(a.texts == b.texts for a, b in zip(off, on, strict=True))
            share = f"{accepted}/{drafted}" if drafted else "-"
            print(
                f"| {name} | {method} | {rate[0]:.1f} | {rate[1]:.1f} | "
                f"{rate[1] / rate[0]:.2f}x | {per_step[0]:.2f} -> {per_step[1]:.2f} | "
                f"{share} | {'yes' if same else 'NO'} |"
            )
    for name in workloads:
        if "draft" in methods:
            runs = totals[(name, "draft")]
            share = sum(x.draft_seconds for x in runs) / sum(x.seconds for x in runs)
            print(f"\n{name}, draft: the draft model's proposals took {share:.0%} of the time")


if __name__ == "__main__":
    main()
