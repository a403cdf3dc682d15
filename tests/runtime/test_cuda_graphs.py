"""The decode-graph step (furnace_trio.runtime.cuda_graphs) without a GPU.

On the CPU the runner's ``cuda_graphs=True`` runs the same padded, static-buffer step as
a GPU captures, eagerly: everything but the capture itself (``tests/test_gpu.py`` checks
that on a GPU). Each test compares a graph runner with a plain one on the same tiny model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.runtime.cuda_graphs import BATCH_SIZES, DecodeGraphs, batch_bucket, context_widths
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.backend import warm_up
from furnace_trio.server.config import ConfigError, ServerConfig

from .._model_fixtures import write_tiny_model

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# Prompt lengths: with 4-token blocks the graphs' widths are 64, 128 and 256 tokens.
PROMPTS = (10, 70, 33)


def _runner(
    path: Path, graphs: bool | None, dtype: str = "float32", kv_dtype: str = "auto"
) -> ModelRunner:
    config, weights = load_hf_directory(path)
    settings = RunnerConfig(
        device="cpu",
        dtype=dtype,
        kv_cache_bytes=1 << 20,
        block_size=BLOCK,
        native=False,
        kv_dtype=kv_dtype,
        cuda_graphs=graphs,
    )
    return ModelRunner(config, weights, settings)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("graphs"), "llama", tied=False)


def fresh_graphs(runner: ModelRunner, *, capture: bool) -> DecodeGraphs:
    """New decode graphs for ``runner`` (made with graphs: it has the scratch block), that
    capture or run their padded steps eagerly (also used by ``test_gpu.py``)."""
    return DecodeGraphs(
        runner.model,
        runner.cache,
        max_context=runner.max_context,
        scratch_block=runner.num_blocks,
        capture=capture,
    )


def _tables() -> list[tuple[int, ...]]:
    return [tuple(range(32 * i, 32 * i + 32)) for i in range(len(PROMPTS))]


def _prefilled(
    path: Path, graphs: bool, kv_dtype: str = "auto"
) -> tuple[ModelRunner, list[list[int]]]:
    """A runner with every prompt of PROMPTS in its cache, and the prompts' tokens."""
    runner = _runner(path, graphs, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = runner.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPTS]
    for seq, (ids, table) in enumerate(zip(prompts, _tables(), strict=True)):
        runner.logits(StepPlan((ChunkPlan(seq, tuple(ids), 0, table),)))
    return runner, prompts


def _decodes(prompts: list[list[int]], which: list[int], extra: int = 0) -> StepPlan:
    """One decode chunk of each sequence in ``which``, ``extra`` tokens after its prompt."""
    tables = _tables()
    chunks = []
    for seq in which:
        pos = len(prompts[seq]) + extra
        token = (7 * seq + extra) % 300
        samples = (SampleSpec(seq, GREEDY),)
        chunks.append(ChunkPlan(seq, (token,), pos, tables[seq], samples))
    return StepPlan(tuple(chunks))


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 100, 128)] == [1, 2, 4, 8, 24, 128, 128]
    assert batch_bucket(BATCH_SIZES[-1] + 1) is None
    assert context_widths(8192, 16) == (256, 512, 1024, 2048, 4096, 8192)
    assert context_widths(300, 4) == (64, 128, 256, 300)
    assert context_widths(100, 16) == (112,)


def test_graph_steps_match_the_plain_runner(model_dir: Path) -> None:
    plain, prompts = _prefilled(model_dir, graphs=False)
    graphed, _ = _prefilled(model_dir, graphs=True)
    assert graphed.graphs is not None and plain.graphs is None
    # 3 sequences (a batch of 4, one padding row), the longest context 71: 128 wide.
    for extra in range(3):
        plan = _decodes(prompts, [0, 1, 2], extra)
        assert graphed.graphs.accepts(plan)
        want = plain.logits(plan)
        got = graphed.graphs.run(plan)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # One sequence alone: batch 1, 64 wide; then two: batch 2, 128 wide; then a context
    # of exactly 128 (its last key in the table's last block; the slots between are the
    # same zeros in both caches).
    for which, extra in (([0], 3), ([2, 1], 3), ([1], 128 - PROMPTS[1] - 1)):
        plan = _decodes(prompts, which, extra)
        torch.testing.assert_close(
            graphed.graphs.run(plan), plain.logits(plan), atol=1e-5, rtol=1e-5
        )
    assert graphed.graphs.captured == ((4, 128), (1, 64), (2, 128), (1, 128))
    # The keys and values the steps wrote are the plain runner's, block for block.
    n = plain.num_blocks
    torch.testing.assert_close(graphed.cache.k[:, :n], plain.cache.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(graphed.cache.v[:, :n], plain.cache.v, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("arch", "kv_dtype"), [("qwen3", "auto"), ("llama", "int8")])
def test_q_k_norms_and_an_int8_cache(tmp_path: Path, arch: str, kv_dtype: str) -> None:
    """Qwen3's q/k norms in the graphed step, and an int8 KV cache with its scales."""
    path = write_tiny_model(tmp_path, arch, tied=False)
    plain, prompts = _prefilled(path, graphs=False, kv_dtype=kv_dtype)
    graphed, _ = _prefilled(path, graphs=True, kv_dtype=kv_dtype)
    assert graphed.graphs is not None
    assert (graphed.cache.scales is not None) == (kv_dtype == "int8")
    for extra in range(3):
        plan = _decodes(prompts, [0, 1, 2], extra)
        want = plain.logits(plan)
        torch.testing.assert_close(graphed.graphs.run(plan), want, atol=1e-5, rtol=1e-5)
    n = plain.num_blocks
    torch.testing.assert_close(graphed.cache.k[:, :n], plain.cache.k)
    if plain.cache.scales is not None and graphed.cache.scales is not None:
        torch.testing.assert_close(graphed.cache.scales[0][:, :n], plain.cache.scales[0])


def test_padding_rows_write_only_the_scratch_block(model_dir: Path) -> None:
    runner, prompts = _prefilled(model_dir, graphs=True)
    assert runner.graphs is not None
    assert runner.cache.num_blocks == runner.num_blocks + 1
    scratch = runner.num_blocks
    assert runner.cache.k[:, scratch].abs().sum() == 0
    before = runner.cache.k[:, :scratch].clone()
    plan = _decodes(prompts, [0, 1, 2])
    runner.step(plan)
    # Only the three sequences' new slots changed outside the scratch block ...
    changed = (runner.cache.k[:, :scratch] != before).flatten(3).any(-1).any(0).flatten()
    slots = {c.block_table[c.start_pos // BLOCK] * BLOCK + c.start_pos % BLOCK for c in plan.chunks}
    assert {int(s) for s in changed.nonzero()} == slots
    # ... and the padding row wrote slot 0 of the scratch block.
    assert runner.cache.k[:, scratch, 0].abs().sum() > 0
    assert runner.cache.k[:, scratch, 1:].abs().sum() == 0


def test_greedy_tokens_match_over_many_steps(model_dir: Path) -> None:
    """Tokens fed back step after step, sequences leaving, widths growing past 128."""
    plain, prompts = _prefilled(model_dir, graphs=False)
    graphed, _ = _prefilled(model_dir, graphs=True)
    tables = _tables()
    outputs: dict[bool, list[list[int]]] = {}
    for graphs, runner in ((False, plain), (True, graphed)):
        last = [p[-1] for p in prompts]
        got: list[list[int]] = [[] for _ in prompts]
        for step in range(60):
            live = [s for s in range(len(prompts)) if not (s == 1 and step >= 20)]
            chunks = tuple(
                ChunkPlan(
                    s,
                    (last[s],),
                    len(prompts[s]) + step,
                    tables[s],
                    (SampleSpec(s, GREEDY),),
                )
                for s in live
            )
            for token in runner.step(StepPlan(chunks)):
                got[token.seq_id].append(token.token_id)
                last[token.seq_id] = token.token_id
        outputs[graphs] = got
    assert outputs[True] == outputs[False]
    assert graphed.graphs is not None
    # 3 sequences up to context 90 (128 wide); from step 20 two, the longer one at 53 (64
    # wide), growing past 64 at step 31.
    assert graphed.graphs.captured == ((4, 128), (2, 64), (2, 128))


def test_mixed_steps_and_rows_without_samples(model_dir: Path) -> None:
    plain, prompts = _prefilled(model_dir, graphs=False)
    graphed, _ = _prefilled(model_dir, graphs=True)
    assert graphed.graphs is not None
    tables = _tables()
    # A prefill chunk in the step: not a graph step, the plain forward pass runs it.
    mixed = StepPlan(
        (
            ChunkPlan(0, (1,), len(prompts[0]), tables[0], (SampleSpec(0, GREEDY),)),
            ChunkPlan(1, (2, 3), len(prompts[1]), tables[1], (SampleSpec(1, GREEDY),)),
        )
    )
    assert not graphed.graphs.accepts(mixed)
    assert graphed.step(mixed) == plain.step(mixed)
    assert graphed.graphs.captured == ()
    # A one-token chunk that does not sample is in the graph, its logits are left out.
    plan = StepPlan(
        (
            ChunkPlan(0, (4,), len(prompts[0]) + 1, tables[0], (SampleSpec(0, GREEDY),)),
            ChunkPlan(2, (5,), len(prompts[2]), tables[2]),
        )
    )
    assert graphed.graphs.accepts(plan)
    want = plain.logits(plan)[:1]
    torch.testing.assert_close(graphed.graphs.run(plan), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_graph_steps_match(model_dir: Path) -> None:
    """The GPU's default dtype: the padded step rounds as the plain one does."""
    plain = _runner(model_dir, graphs=False, dtype="bfloat16")
    graphed = _runner(model_dir, graphs=True, dtype="bfloat16")
    tables = _tables()
    for runner in (plain, graphed):
        runner.logits(StepPlan((ChunkPlan(0, tuple(range(1, 20)), 0, tables[0]),)))
    plan = StepPlan((ChunkPlan(0, (9,), 19, tables[0], (SampleSpec(0, GREEDY),)),))
    assert graphed.graphs is not None
    torch.testing.assert_close(graphed.graphs.run(plan), plain.logits(plan), atol=0, rtol=0)


def test_warm_up_captures_every_batch_size_at_the_narrowest_width(model_dir: Path) -> None:
    runner = _runner(model_dir, graphs=True)
    warm_up(runner, 20)  # as the server does before serving, with its max_running
    assert runner.graphs is not None
    assert runner.graphs.captured == tuple((b, 64) for b in (1, 2, 4, 8, 16, 24))


def test_a_failed_capture_turns_the_graphs_off_and_the_step_still_runs(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Here a real capture fails (no CUDA): logged once, the step runs op by op, and later
    steps do not try again."""
    plain, prompts = _prefilled(model_dir, graphs=False)
    runner, _ = _prefilled(model_dir, graphs=True)
    runner.graphs = fresh_graphs(runner, capture=True)
    with caplog.at_level(logging.WARNING, logger="furnace_trio.runtime.cuda_graphs"):
        for extra in range(2):
            plan = _decodes(prompts, [0, 1, 2], extra)
            assert runner.step(plan) == plain.step(plan)
    assert not runner.graphs.enabled
    assert not runner.graphs.accepts(_decodes(prompts, [0]))
    assert runner.graphs.captured == ()

    def warnings() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "furnace_trio.runtime.cuda_graphs"
        ]

    assert len(warnings()) == 1
    assert warnings()[0].startswith("decode graphs off: capturing 4 sequences")
    # Warm-up on such a runner tries nothing more.
    runner.capture_graphs(20)
    assert runner.graphs.captured == () and len(warnings()) == 1


def test_native_cpu_runners_take_no_graphs(model_dir: Path) -> None:
    config, weights = load_hf_directory(model_dir)
    settings = RunnerConfig(device="cpu", kv_cache_bytes=1 << 20, cuda_graphs=True)
    runner = ModelRunner(config, weights, settings)
    assert runner.graphs is None
    assert runner.cache.num_blocks == runner.num_blocks
    # The default: graphs only on a CUDA device.
    assert _runner(model_dir, graphs=None).graphs is None


def test_server_flag() -> None:
    assert ServerConfig().cuda_graphs is True
    assert ServerConfig.from_env({"FURNACE_CUDA_GRAPHS": "0"}).cuda_graphs is False
    with pytest.raises(ConfigError, match="FURNACE_CUDA_GRAPHS"):
        ServerConfig.from_env({"FURNACE_CUDA_GRAPHS": "maybe"})


def test_a_step_that_scores_a_prompt_is_never_a_graph_step(model_dir: Path) -> None:
    """A one-token chunk that scores the next prompt token, beside a decode: every row is
    one token, but the graphs leave out rows that do not sample, so the plain forward pass
    runs the step, and the score is the plain runner's."""
    plain, prompts = _prefilled(model_dir, graphs=False)
    graphed, _ = _prefilled(model_dir, graphs=True)
    assert graphed.graphs is not None
    tables = _tables()
    scored = ChunkPlan(3, (7,), 0, tuple(range(96, 128)), score_ids=(8,), score_top=1)
    plan = StepPlan(
        (ChunkPlan(0, (4,), len(prompts[0]), tables[0], (SampleSpec(0, GREEDY),)), scored)
    )
    assert graphed.graphs.accepts(plan)  # by its shape alone it would be one
    assert graphed.step(plan) == plain.step(plan)
    assert graphed.graphs.captured == ()
    kept = graphed._prompt_scores[3]
    assert kept == plain._prompt_scores[3] and [s.token_id for s in kept] == [8]
