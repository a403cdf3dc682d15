"""The forward pass against Hugging Face transformers, the numerical reference.

Tiny random models of every supported architecture are written to disk by the test
(``write_tiny_model``), loaded through our loader and through transformers, and compared
logit for logit (float32, tight tolerance) with prompt lengths that cross KV block
boundaries, in whole, chunked and ragged batched steps. Every comparison runs twice: with
the native CPU kernels (decode attention, fused norms/rotary/SiLU) and with torch alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.runtime import runner as runner_module
from furnace_trio.runtime import step_inputs as step_inputs_module
from furnace_trio.runtime.attention import chunk_attention
from furnace_trio.runtime.layers import RMSNorm
from furnace_trio.runtime.native import quantize_kv_rows
from furnace_trio.runtime.quant import NativeQ4Linear, dequantize_q4, quantize_q4
from furnace_trio.runtime.runner import KV_DTYPES, ModelRunner, RunnerConfig, build_inputs
from furnace_trio.runtime.step_inputs import PrefillBatch, chunk_mask
from furnace_trio.server import config_values as server_config

from .._model_fixtures import GEMMA3_WINDOW, write_tiny_model

BLOCK = 4
TOL = 2e-5

ARCHS = [
    ("llama", False, False),
    ("llama", True, True),
    ("mistral", False, False),
    ("qwen2", True, False),
    ("qwen2", False, False),
    ("qwen3", True, False),
    ("qwen3", False, False),
    ("gemma3", True, False),
    ("gemma3", False, True),  # linear rope scaling on the global layer
]


def _runner(
    path: Path,
    *,
    native: bool = True,
    quantization: str = "none",
    kv_dtype: str = "auto",
    split_chunks_upto: int | None = None,
) -> ModelRunner:
    config, weights = load_hf_directory(path)
    settings = RunnerConfig(
        device="cpu",
        kv_cache_bytes=1 << 22,
        block_size=BLOCK,
        native=native,
        quantization=quantization,
        kv_dtype=kv_dtype,
        split_chunks_upto=split_chunks_upto,
    )
    return ModelRunner(config, weights, settings)


def _reference(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


def _ref_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _table(first: int, n: int = 16) -> tuple[int, ...]:
    return tuple(range(first, first + n))


@pytest.fixture(
    params=[(*a, n) for a in ARCHS for n in (True, False)],
    ids=lambda a: (
        f"{a[0]}-{'tied' if a[1] else 'untied'}"
        f"{('-llama3rope' if a[0] == 'llama' else '-linearrope') if a[2] else ''}"
        f"-{'native' if a[3] else 'torch'}"
    ),
)
def tiny(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[ModelRunner, torch.nn.Module, int]:
    arch, tied, rope3, native = request.param
    path = write_tiny_model(tmp_path, arch, tied=tied, rope_llama3=rope3)
    runner = _runner(path, native=native)
    assert (runner.model.layers[0].self_attn.kernels is not None) == native
    return runner, _reference(path), runner.config.vocab_size


def test_prefill_then_decode_matches_transformers(
    tiny: tuple[ModelRunner, torch.nn.Module, int],
) -> None:
    runner, ref, vocab = tiny
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (23,), generator=gen).tolist()
    expected = _ref_logits(ref, ids)
    table = _table(0)
    prompt = 13  # crosses three block boundaries
    got = runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:prompt]), 0, table),)))
    torch.testing.assert_close(got[0], expected[prompt - 1], atol=TOL, rtol=TOL)
    for pos in range(prompt, len(ids)):
        got = runner.logits(StepPlan((ChunkPlan(1, (ids[pos],), pos, table),)))
        torch.testing.assert_close(got[0], expected[pos], atol=TOL, rtol=TOL)


def test_chunked_prefill_matches_whole(tiny: tuple[ModelRunner, torch.nn.Module, int]) -> None:
    runner, ref, vocab = tiny
    ids = torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = _ref_logits(ref, ids)
    table = _table(3)
    pos = 0
    for size in (7, 1, 9, 13):
        got = runner.logits(StepPlan((ChunkPlan(5, tuple(ids[pos : pos + size]), pos, table),)))
        pos += size
        torch.testing.assert_close(got[0], expected[pos - 1], atol=TOL, rtol=TOL)


def test_ragged_batch_matches_each_alone(tiny: tuple[ModelRunner, torch.nn.Module, int]) -> None:
    """Prefills, chunks and decodes of different lengths share one step."""
    runner, ref, vocab = tiny
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (17, 9, 22, 5)]
    expected = [_ref_logits(ref, s) for s in seqs]
    tables = [_table(16 * i) for i in range(len(seqs))]
    # Step 1: different prefill lengths (one sequence only partly).
    first = [11, 9, 6, 5]
    plan = StepPlan(
        tuple(ChunkPlan(i, tuple(s[: first[i]]), 0, tables[i]) for i, s in enumerate(seqs))
    )
    got = runner.logits(plan)
    for i in range(len(seqs)):
        torch.testing.assert_close(got[i], expected[i][first[i] - 1], atol=TOL, rtol=TOL)
    # Step 2: decodes next to a prefill chunk, at different positions.
    chunks = (
        ChunkPlan(0, (seqs[0][11],), 11, tables[0]),
        ChunkPlan(2, tuple(seqs[2][6:20]), 6, tables[2]),
        ChunkPlan(3, (seqs[3][4],), 4, tables[3]),
    )
    # seq 3 re-decodes its last prompt position: overwriting a slot with the same K/V is harmless
    got = runner.logits(StepPlan(chunks))
    torch.testing.assert_close(got[0], expected[0][11], atol=TOL, rtol=TOL)
    torch.testing.assert_close(got[1], expected[2][19], atol=TOL, rtol=TOL)
    torch.testing.assert_close(got[2], expected[3][4], atol=TOL, rtol=TOL)


def _batched_prefill_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """``runner.logits(plan)`` with the step's prefill rows attended in one call, the CUDA
    form (:class:`PrefillBatch`), here on the CPU."""
    inputs = build_inputs(plan, runner.block_size, runner.device, all_rows=True)
    c = runner.config
    window = c.sliding_window if any(c.sliding_layers) else None
    batch = PrefillBatch.build(
        inputs, runner.block_size, torch.float32, c.num_heads * c.head_dim, window
    )
    assert batch is not None
    with torch.inference_mode():
        return runner.model(dataclasses.replace(inputs, prefill=batch), runner.cache)


@pytest.mark.parametrize(
    ("arch", "kv_dtype"), [("qwen3", "auto"), ("qwen3", "int8"), ("gemma3", "auto")]
)
def test_batched_prefill_rows_equal_rows_attended_one_by_one(
    tmp_path: Path, arch: str, kv_dtype: str
) -> None:
    """Fresh prompts of different lengths, chunks after cached tokens and decodes in one
    step: the prefill rows attended in one padded call give the logits the per-row path
    gives (and, with a float cache, transformers' own). Gemma 3's sliding layers take the
    batch's windowed mask (its prompts outgrow the tiny model's window)."""
    path = write_tiny_model(tmp_path, arch, tied=arch == "gemma3")
    ref = _reference(path)
    vocab = load_hf_directory(path)[0].vocab_size
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (17, 9, 22, 5)]
    tables = [_table(16 * i) for i in range(len(seqs))]
    first = [11, 2, 6, 5]
    steps = [
        tuple(ChunkPlan(i, tuple(s[: first[i]]), 0, tables[i]) for i, s in enumerate(seqs)),
        (
            ChunkPlan(0, (seqs[0][11],), 11, tables[0]),
            ChunkPlan(1, tuple(seqs[1][2:9]), 2, tables[1]),
            ChunkPlan(2, tuple(seqs[2][6:20]), 6, tables[2]),
            ChunkPlan(3, (seqs[3][4],), 4, tables[3]),
        ),
    ]
    rows = _runner(path, native=False, kv_dtype=kv_dtype)
    batched = _runner(path, native=False, kv_dtype=kv_dtype)
    for chunks in steps:
        want = rows.logits(StepPlan(chunks))
        got = _batched_prefill_logits(batched, StepPlan(chunks))
        # An int8 cache: the batch reads a fresh prompt's own keys back from the cache,
        # rounded, where the per-row path uses them as computed; later layers' keys, and so
        # the next step, differ by as much.
        tol = 1e-2 if kv_dtype == "int8" else TOL
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        if kv_dtype == "auto":
            for chunk, logits in zip(chunks, got, strict=True):
                full = seqs[chunk.seq_id][: chunk.start_pos + len(chunk.token_ids)]
                expected = _ref_logits(ref, full)[-1]
                torch.testing.assert_close(logits, expected, atol=TOL, rtol=TOL)


def test_prefill_batches_only_when_it_pays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill row is attended on its own; so are rows whose padded mask, or whose
    keys copied once per query head, would be too large."""
    plan = StepPlan((ChunkPlan(0, (1, 2, 3), 0, _table(0)), ChunkPlan(1, (4, 5), 0, _table(16))))
    cpu = torch.device("cpu")
    inputs = build_inputs(plan, BLOCK, cpu)
    assert PrefillBatch.build(inputs, BLOCK, torch.float32, 1) is not None
    one = build_inputs(StepPlan(plan.chunks[:1]), BLOCK, cpu)
    assert PrefillBatch.build(one, BLOCK, torch.float32, 1) is None
    # 2 rows x 3 keys x 3 queries in the mask; x 4 elements per key when heads x size = 4.
    monkeypatch.setattr(step_inputs_module, "PREFILL_BATCH_ELEMENTS", 2 * 3 * 3)
    assert PrefillBatch.build(inputs, BLOCK, torch.float32, 1) is not None
    assert PrefillBatch.build(inputs, BLOCK, torch.float32, 4) is None
    monkeypatch.setattr(step_inputs_module, "PREFILL_BATCH_ELEMENTS", 2 * 3 * 3 - 1)
    assert PrefillBatch.build(inputs, BLOCK, torch.float32, 1) is None


@pytest.mark.parametrize("past", [0, 7])
def test_chunk_attention_with_expanded_keys_equals_grouped(past: int) -> None:
    """The CUDA form of a chunk's attention (keys repeated per query head, no
    ``enable_gqa``) computes what the grouped form computes: 9 query heads over 3 KV heads,
    a fresh prompt and a chunk after 7 cached tokens."""
    torch.manual_seed(0)
    qlen, ctx = 5, past + 5
    q = torch.randn(qlen, 9, 16)
    keys, values = torch.randn(ctx, 3, 16), torch.randn(ctx, 3, 16)
    mask = chunk_mask(qlen, past, q.dtype, q.device) if past else None
    grouped = chunk_attention(q, keys, values, mask, 0.25, expand_kv=False)
    expanded = chunk_attention(q, keys, values, mask, 0.25, expand_kv=True)
    assert grouped.shape == (qlen, 9, 16)
    torch.testing.assert_close(expanded, grouped)
    # Query head 4 reads KV head 1 (heads 3 to 5 share it): plain attention, by hand.
    scores = (q[:, 4] @ keys[:, 1].T) * 0.25
    if mask is None:
        mask = chunk_mask(qlen, 0, q.dtype, q.device)
    want = torch.softmax(scores + mask, dim=-1) @ values[:, 1]
    torch.testing.assert_close(grouped[:, 4], want)


def test_block_copy_forks_a_sequence(tiny: tuple[ModelRunner, torch.nn.Module, int]) -> None:
    """A child sharing full blocks and a copied partial block decodes like its parent."""
    runner, ref, vocab = tiny
    ids = torch.randint(0, vocab, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = _ref_logits(ref, ids)
    parent = (0, 1, 2)
    runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:9]), 0, parent),)))
    child = (0, 1, 7)  # block 2 holds position 8 (partial): the child gets a copy in block 7
    got = runner.logits(StepPlan((ChunkPlan(2, (ids[9],), 9, child),), block_copies=((2, 7),)))
    torch.testing.assert_close(got[0], expected[9], atol=TOL, rtol=TOL)


def test_plan_with_short_block_table_is_refused(
    tiny: tuple[ModelRunner, torch.nn.Module, int],
) -> None:
    runner, _, _ = tiny
    with pytest.raises(ValueError, match="block table"):
        runner.logits(StepPlan((ChunkPlan(1, tuple(range(9)), 0, (0, 1)),)))


def _ragged_decode(vocab: int) -> tuple[list[list[int]], StepPlan, StepPlan]:
    """Three sequences of 6, 13 and 2 tokens: a prefill step of all but each one's last
    token, and the decode step of those last tokens (ragged contexts)."""
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 13, 2)]
    tables = [_table(16 * i) for i in range(len(seqs))]
    prompts = StepPlan(tuple(ChunkPlan(i, tuple(s[:-1]), 0, tables[i]) for i, s in enumerate(seqs)))
    decodes = StepPlan(
        tuple(ChunkPlan(i, (s[-1],), len(s) - 1, tables[i]) for i, s in enumerate(seqs))
    )
    return seqs, prompts, decodes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_fused_decode_equals_per_op_path(tmp_path: Path, arch: str) -> None:
    """All-decode int8 steps run every layer in one native call; the per-op path (the same
    kernels called one by one from Python) must give bitwise the same logits, for ragged
    contexts and a bias (qwen2), and stay close to the float reference."""
    path = write_tiny_model(tmp_path, arch, tied=False, rope_llama3=False)
    runner = _runner(path, quantization="int8")
    assert runner.model.kernels is not None
    assert runner.cache.k.dtype == torch.float16  # int8 with native kernels: half the KV bytes
    seqs, prompts, decodes = _ragged_decode(runner.config.vocab_size)
    runner.logits(prompts)
    assert runner.model._decode_layer_ptrs(runner.cache, runner.model.kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    per_op = runner.logits(decodes)
    assert torch.equal(fused, per_op)
    ref = _ref_logits(_reference(path), seqs[1])[-1]
    assert float((fused[1] - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_q4_fused_decode_equals_per_op_path(tmp_path: Path, arch: str) -> None:
    """The 4-bit runtime on weights already on the 4-bit grid (as a Q4_1 file's): ``auto``
    turns every layer's linears into 4-bit ones, losslessly; the fused all-decode step equals
    the per-op path bitwise and stays close to the float runtime on the same weights (only
    activations are rounded, 8 bits per group of 32). qwen3 has q/k norms: per-op only."""
    path = write_tiny_model(tmp_path, arch, tied=False, rope_llama3=False)
    config, weights = load_hf_directory(path)
    grid = {
        name: dequantize_q4(*quantize_q4(w)) if w.dim() == 2 and "layers." in name else w
        for name, w in weights.items()
    }

    def make(quantization: str) -> ModelRunner:
        settings = RunnerConfig(
            device="cpu", kv_cache_bytes=1 << 22, block_size=BLOCK, quantization=quantization
        )
        return ModelRunner(config, dict(grid), settings)

    runner, reference = make("auto"), make("none")
    assert runner.quantization == "q4"
    layer_kinds = {
        type(m).__name__ for n, m in runner.model.named_modules() if "layers." in n and "proj" in n
    }
    assert layer_kinds == {NativeQ4Linear.__name__}
    _, prompts, decodes = _ragged_decode(config.vocab_size)
    runner.logits(prompts)
    reference.logits(prompts)
    kernels = runner.model.kernels
    if arch == "qwen3":
        assert kernels is None  # q/k norms: torch ops around the native linears
    else:
        assert kernels is not None
        assert runner.model._decode_layer_ptrs(runner.cache, kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    assert torch.equal(fused, runner.logits(decodes))
    want = reference.logits(decodes)
    assert float((fused - want).norm() / want.norm()) < 0.03


def test_kv_dtype_follows_the_runtime(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    assert _runner(path).cache.k.dtype == torch.float32  # float reference: float32 KV
    assert _runner(path, native=False, quantization="int8").cache.k.dtype == torch.float32
    config, weights = load_hf_directory(path)
    settings = RunnerConfig(
        device="cpu", kv_cache_bytes=1 << 22, quantization="int8", kv_dtype="model"
    )
    assert ModelRunner(config, weights, settings).cache.k.dtype == torch.float32
    # float16 on request, for the float runtime too (native and torch paths): decodes that
    # read it stay close to a float32 cache's
    _, prompts, decodes = _ragged_decode(config.vocab_size)
    for native in (True, False):
        half, full = _runner(path, native=native, kv_dtype="float16"), _runner(path, native=native)
        assert half.cache.k.dtype == torch.float16 and half.quantization == "none"
        assert full.cache.k.dtype == torch.float32
        half.logits(prompts)
        full.logits(prompts)
        got, want = half.logits(decodes), full.logits(decodes)
        assert not torch.equal(got, want)
        assert float((got - want).norm() / want.norm()) < 1e-3
    with pytest.raises(ValueError, match="kv_dtype"):
        ModelRunner(config, weights, RunnerConfig(device="cpu", kv_dtype="int4"))
    # the server's settings (which do not import torch) accept the same names
    assert server_config.KV_CACHE_DTYPES == KV_DTYPES


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_kv_cache(tmp_path: Path, arch: str) -> None:
    """``kv_dtype="int8"``: keys and values stored as int8 with a scale per token and KV
    head. The fused decode equals the per-op path bitwise, the torch path (no native
    kernels) stores the same bytes and stays close, and all of them stay close to a
    float16 cache; about 1.9 times the blocks of a float16 cache in the same bytes."""
    path = write_tiny_model(tmp_path, arch, tied=False, rope_llama3=False)
    runner = _runner(path, quantization="int8", kv_dtype="int8")
    half = _runner(path, quantization="int8")
    torch_path = _runner(path, native=False, quantization="int8", kv_dtype="int8")
    assert runner.cache.k.dtype == torch.int8 and runner.cache.scales is not None
    assert torch_path.cache.k.dtype == torch.int8 and torch_path.model.kernels is None
    assert half.cache.k.dtype == torch.float16
    assert runner.cache.num_blocks / half.cache.num_blocks == pytest.approx(
        2 * runner.config.head_dim / (runner.config.head_dim + 4), rel=0.01
    )
    _, prompts, decodes = _ragged_decode(runner.config.vocab_size)
    for r in (runner, half, torch_path):
        r.logits(prompts)
    assert runner.model._decode_layer_ptrs(runner.cache, runner.model.kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    assert torch.equal(fused, runner.logits(decodes))
    want = half.logits(decodes)
    assert float((fused - want).norm() / want.norm()) < 0.02
    got = torch_path.logits(decodes)
    assert float((got - fused).norm() / fused.norm()) < 0.005
    assert bool((fused.argmax(-1) == want.argmax(-1)).all())


def test_layer_kv_int8_store_and_gather(tmp_path: Path) -> None:
    """The torch path's int8 store writes native.quantize_kv_rows' bytes and scales (the
    native store's, see test_native.test_rope_store); gather gives back ``q * scale``."""
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    layer = _runner(path, native=False, kv_dtype="int8").cache.layers[1]
    assert layer.scales is not None
    _, _, kv_heads, dim = layer.k.shape
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 5, kv_heads, dim, generator=gen) * 3
    slots = torch.tensor([4, 5, 6, 7, 13])  # blocks 1 and 3
    layer.store(slots, k, v)
    keys, values = layer.gather(torch.tensor([1, 3]), torch.float32)
    keys, values = keys.flatten(0, 1)[[0, 1, 2, 3, 5]], values.flatten(0, 1)[[0, 1, 2, 3, 5]]
    for got, x, cache, scale in (
        (keys, k, layer.k, layer.scales[0]),
        (values, v, layer.v, layer.scales[1]),
    ):
        q, s = quantize_kv_rows(x)
        assert torch.equal(cache.flatten(0, 1)[slots], q)
        assert torch.equal(scale.flatten(0, 1)[slots], s)
        torch.testing.assert_close(got, q.float() * s[..., None])
        assert float((got - x).abs().max()) <= float(s.max()) / 2 + 1e-6


def test_int8_kv_block_copies_carry_the_scales(tmp_path: Path) -> None:
    """A copied block (copy-on-write after a fork) takes its int8 values and their scales."""
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    runner = _runner(path, quantization="int8", kv_dtype="int8")
    runner.logits(StepPlan((ChunkPlan(1, tuple(range(1, 9)), 0, _table(0)),)))
    cache = runner.cache
    assert cache.scales is not None
    cache.copy_blocks(((0, 40), (1, 41)))
    for src, dst in ((0, 40), (1, 41)):
        for tensor in (cache.k, cache.v, *cache.scales):
            assert torch.equal(tensor[:, dst], tensor[:, src])
    assert bool(cache.scales[0][:, 0].ne(0).all())  # the copied scales are real ones


@pytest.mark.parametrize("split", [0, None], ids=["chunk-path", "short-chunks-as-rows"])
@pytest.mark.parametrize(
    ("kv_dtype", "cache_dtype", "tol"), [("auto", torch.float16, 1e-2), ("int8", torch.int8, 2e-2)]
)
def test_int8_chunked_prefill_over_the_cache(
    tmp_path: Path, kv_dtype: str, cache_dtype: torch.dtype, tol: float, split: int | None
) -> None:
    """Chunks after cached tokens read the float16 KV, or the int8 one dequantized: through
    the torch attention path over the gathered cache (``split`` 0), or (the default with
    the native kernels) as rows of the decode path."""
    path = write_tiny_model(tmp_path, "qwen2", tied=False, rope_llama3=False)
    runner = _runner(path, quantization="int8", kv_dtype=kv_dtype, split_chunks_upto=split)
    assert runner.cache.k.dtype == cache_dtype
    ids = torch.randint(
        0, runner.config.vocab_size, (30,), generator=torch.Generator().manual_seed(6)
    )
    ids_t = tuple(ids.tolist())
    whole = runner.logits(StepPlan((ChunkPlan(1, ids_t, 0, _table(0)),)))[0]
    pos = 0
    for size in (7, 1, 9, 13):
        got = runner.logits(StepPlan((ChunkPlan(2, ids_t[pos : pos + size], pos, _table(16)),)))
        pos += size
    assert float((got[0] - whole).norm() / whole.norm()) < tol
    ref = _ref_logits(_reference(path), list(ids_t))[-1]
    assert float((got[0] - ref).norm() / ref.norm()) < 0.02


def test_build_inputs_runs_short_chunks_as_one_token_rows() -> None:
    """With ``split_upto``, a chunk of that many tokens or fewer becomes one row per token,
    row ``i`` with the context up to its own token and the chunk's block table; a longer
    chunk stays one row, and only a chunk's last token gives logits."""
    params = SamplingParams(temperature=0.0)
    plan = StepPlan(
        (
            ChunkPlan(1, (10, 11, 12), 3, (7, 2), (SampleSpec(1, params),)),
            ChunkPlan(2, (20,), 4, (5, 6), (SampleSpec(2, params),)),
            ChunkPlan(3, (30, 31, 32, 33), 0, (1,)),
        )
    )
    got = build_inputs(plan, BLOCK, torch.device("cpu"), split_upto=3)
    assert got.input_ids.tolist() == [10, 11, 12, 20, 30, 31, 32, 33]
    assert got.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 6 * 4, 4, 5, 6, 7]
    assert got.query_starts == (0, 1, 2, 3, 4, 8)
    assert got.context_lens == (4, 5, 6, 5, 4)
    assert got.block_tables.tolist() == [[7, 2], [7, 2], [7, 2], [5, 6], [1, 0]]
    assert got.decode_rows == (0, 1, 2, 3) and got.prefill_rows == (4,)
    assert got.decode_context_lens.tolist() == [4, 5, 6, 5]
    assert got.logit_rows.tolist() == [2, 3]
    unsplit = build_inputs(plan, BLOCK, torch.device("cpu"))
    assert unsplit.decode_rows == (1,) and unsplit.prefill_rows == (0, 2)
    assert torch.equal(unsplit.slot_mapping, got.slot_mapping)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_a_short_chunk_gives_what_decoding_its_tokens_one_by_one_gives(
    tmp_path: Path, quantization: str
) -> None:
    """A chunk after cached tokens runs as rows of the decode path: its logits are bitwise
    those of decoding its tokens one step each (the same kernels, row by row, the same
    context per row), and close to the chunk path's (torch attention over the gathered
    cache)."""
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    runner = _runner(path, quantization=quantization)  # short chunks as rows: the default
    chunk_path = _runner(path, quantization=quantization, split_chunks_upto=0)
    ids = torch.randint(
        0, runner.config.vocab_size, (28,), generator=torch.Generator().manual_seed(9)
    )
    prefix, tail = tuple(ids[:20].tolist()), tuple(ids[20:].tolist())
    got = {}
    for name, r, first in (("rows", runner, 0), ("steps", runner, 16), ("chunk", chunk_path, 0)):
        r.logits(StepPlan((ChunkPlan(1, prefix, 0, _table(first)),)))
        if name == "steps":
            for i, token in enumerate(tail):
                step = StepPlan((ChunkPlan(1, (token,), len(prefix) + i, _table(first)),))
                got[name] = r.logits(step)[0]
        else:
            got[name] = r.logits(StepPlan((ChunkPlan(1, tail, len(prefix), _table(first)),)))[0]
    assert torch.equal(got["rows"], got["steps"])
    # Not bitwise: the chunk path attends over float32 keys of a fresh prompt and reads the
    # cache otherwise; the activations' rounding to int8 per group moves the rest.
    rel = float((got["rows"] - got["chunk"]).norm() / got["chunk"].norm())
    assert rel < 2e-2
    assert int(got["rows"].argmax()) == int(got["chunk"].argmax())


def test_rotary_rows_match_the_formula_as_the_table_grows(tmp_path: Path) -> None:
    """cos/sin rows come from a table grown on demand (by doubling); each row is what the
    rotary formula gives for that position, and a shorter step reuses the table."""
    runner = _runner(write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=True))
    model = runner.model
    sizes = []
    for end in (5, 300, 1000, 40):
        gen = torch.Generator().manual_seed(end)
        positions = torch.randint(0, end, (17,), generator=gen)
        positions[0] = end - 1
        cos, sin = model._rotary(positions, end)
        freqs = positions.float()[:, None] * model.inv_freq[None, :]
        half = freqs.sin()
        torch.testing.assert_close(cos, torch.cat((freqs, freqs), -1).cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, torch.cat((-half, half), -1), rtol=0, atol=1e-6)
        sizes.append(model._rope[0].shape[0])
    assert sizes[0] == 256  # the first table
    assert sizes[1] >= 300 and sizes[2] >= 1000  # grown
    assert sizes[3] == sizes[2]  # reused


def test_build_inputs_flattens_a_mixed_step() -> None:
    """A prefill chunk that does not sample, a decode that does and a longer decode: every
    field, from the one int64 tensor the step's integers are packed into."""
    params = SamplingParams(temperature=0.0)
    plan = StepPlan(
        (
            ChunkPlan(1, (10, 11, 12), 3, (7, 2)),  # positions 3..5 over blocks of 4
            ChunkPlan(2, (20,), 4, (5, 6), (SampleSpec(2, params),)),
            ChunkPlan(3, (30,), 9, (1, 8, 9), (SampleSpec(3, params),)),
        )
    )
    got = build_inputs(plan, BLOCK, torch.device("cpu"))
    assert got.input_ids.tolist() == [10, 11, 12, 20, 30]
    assert got.positions.tolist() == [3, 4, 5, 4, 9]
    assert got.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 6 * 4 + 0, 9 * 4 + 1]
    assert got.query_starts == (0, 3, 4, 5)
    assert got.context_lens == (6, 5, 10)
    assert got.block_tables.tolist() == [[7, 2, 0], [5, 6, 0], [1, 8, 9]]
    assert got.decode_rows == (1, 2) and got.prefill_rows == (0,)
    assert got.decode_index.tolist() == [1, 2]
    assert got.decode_context_lens.tolist() == [5, 10]
    assert got.logit_rows.tolist() == [3, 4]  # the prefill chunk does not sample
    assert got.slot_mapping.is_contiguous() and got.block_tables.is_contiguous()


@pytest.mark.parametrize("kv_dtype", ["auto", "float16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_torch_path_keeps_every_tensor_on_the_device_and_never_syncs(
    tmp_path: Path, arch: str, kv_dtype: str
) -> None:
    """The CUDA path, checked without a GPU: on the ``meta`` device (shapes, no data) an op
    given a tensor left on the CPU raises, and so does every read of a value on the host
    (``.item()``, ``int(t)``, ``.tolist()``). So a forward pass that runs there places every
    tensor on the runner's device and makes no host round trip; the one a step makes, the
    sampled ids, comes after it."""
    config, weights = load_hf_directory(write_tiny_model(tmp_path, arch, tied=False))
    settings = RunnerConfig(
        device="meta",
        dtype="bfloat16",
        kv_cache_bytes=1 << 22,
        block_size=BLOCK,
        kv_dtype=kv_dtype,
    )
    runner = ModelRunner(config, weights, settings)
    assert runner.model.kernels is None and runner.cache.k[0].device.type == "meta"
    vocab = config.vocab_size
    prompt = ChunkPlan(1, tuple(range(10)), 0, _table(0))
    assert runner.logits(StepPlan((prompt,))).shape == (1, vocab)
    assert runner.prompt_logits(range(10), chunk=4).shape == (10, vocab)
    mixed = StepPlan(
        (
            ChunkPlan(1, (3,), 10, _table(0), (SampleSpec(1, SamplingParams()),)),
            ChunkPlan(2, tuple(range(6)), 0, _table(16)),
            ChunkPlan(3, (7, 8, 9), 4, _table(32)),  # a chunk after cached tokens
            ChunkPlan(4, (5,), 20, _table(48)),
        ),
        block_copies=((0, 60),),
    )
    runner.cache.copy_blocks(mixed.block_copies)
    assert runner.logits(mixed).shape == (4, vocab)
    decodes = StepPlan(tuple(ChunkPlan(s, (s,), 11 + s, _table(16 * s)) for s in range(3)))
    assert runner.logits(decodes).shape == (3, vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_the_float32_formula_rounded_once_to_its_dtype(dtype: torch.dtype) -> None:
    """``x * rsqrt(mean(x^2) + eps) * w`` in float32, whatever the input dtype, then
    rounded to it: within one rounding (half a unit in the last place) of the exact value."""
    torch.manual_seed(0)
    x = (torch.randn(5, 64) * 3).to(dtype)
    w = (torch.rand(64) + 0.5).to(dtype)
    out = RMSNorm(w, 1e-5)(x)
    h = x.double()
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert out.dtype == dtype
    half_ulp = torch.finfo(dtype).eps / 2
    torch.testing.assert_close(out.double(), exact, rtol=max(half_ulp, 1e-6), atol=0)


def test_prompt_scores_are_the_models_logprobs_of_each_next_prompt_token(
    tiny: tuple[ModelRunner, torch.nn.Module, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scored prompt in two chunks (40 tokens on the chunk path, scored 16 rows at a
    time, then 10 as one-token rows where the native kernels run), beside another
    sequence's prefill: its first sampled token carries the logprob of every prompt token
    after the first, and the top alternatives, as transformers computes them; later
    tokens carry none."""
    monkeypatch.setattr(runner_module, "SCORE_ROWS", 16)
    runner, ref, vocab = tiny
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (50,), generator=gen).tolist()
    other = torch.randint(0, vocab, (5,), generator=gen).tolist()
    expected = torch.log_softmax(_ref_logits(ref, ids), dim=-1)
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)

    def spec(seq_id: int, prompt: list[int], params: SamplingParams) -> SampleSpec:
        return SampleSpec(seq_id, params, tuple(prompt), ())

    table = _table(0)
    first = runner.step(
        StepPlan(
            (
                ChunkPlan(1, tuple(ids[:40]), 0, table, score_ids=tuple(ids[1:41]), score_top=2),
                ChunkPlan(
                    2,
                    tuple(other),
                    0,
                    _table(20, 2),
                    samples=(spec(2, other, SamplingParams(temperature=0)),),
                ),
            )
        )
    )
    assert [t.seq_id for t in first] == [2] and first[0].prompt_logprobs is None
    last = ChunkPlan(
        1,
        tuple(ids[40:]),
        40,
        table,
        samples=(spec(1, ids, scored),),
        score_ids=tuple(ids[41:]),
        score_top=2,
    )
    (token,) = runner.step(StepPlan((last,)))
    scores = token.prompt_logprobs
    assert scores is not None
    assert [s.token_id for s in scores] == ids[1:]
    got = torch.tensor([s.logprob for s in scores])
    want = expected[torch.arange(49), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for pos, s in enumerate(scores):
        top_ids = [t.token_id for t in s.top_logprobs]
        top_values = torch.tensor([t.logprob for t in s.top_logprobs])
        torch.testing.assert_close(top_values, expected[pos].topk(2).values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(expected[pos][top_ids], top_values, atol=1e-4, rtol=1e-4)
    assert token.token_id == int(expected[49].argmax())
    follow = ChunkPlan(
        1,
        (token.token_id,),
        50,
        table,
        samples=(SampleSpec(1, scored, tuple(ids), (token.token_id,)),),
    )
    (after,) = runner.step(StepPlan((follow,)))
    assert after.prompt_logprobs is None


def test_a_prompt_released_between_its_chunks_leaves_no_scores(tmp_path: Path) -> None:
    """An abort between a scored prompt's chunks releases its sequence: the runner drops
    the scores it kept for it."""
    runner = _runner(write_tiny_model(tmp_path, "llama", tied=False))
    ids = tuple(range(1, 11))
    runner.step(StepPlan((ChunkPlan(3, ids[:6], 0, _table(0), score_ids=ids[1:7]),)))
    assert runner._prompt_scores.keys() == {3}
    runner.step(StepPlan((), released=(3,)))
    assert runner._prompt_scores == {}


def test_gemma3_takes_the_per_op_path_with_native_attention(tmp_path: Path) -> None:
    """The fused all-layers C call is Llama's (no extra norms, SiLU, no window): Gemma 3
    runs native linears and the windowed native attention between torch's elementwise ops."""
    runner = _runner(write_tiny_model(tmp_path, "gemma3", tied=True), quantization="int8")
    assert runner.model.attends_natively
    assert runner.model.kernels is None  # no fused layer path
    windows = [layer.self_attn.window for layer in runner.model.layers]
    assert windows == [GEMMA3_WINDOW] * 5 + [None]


def test_a_scored_chunk_run_again_keeps_one_score_per_position(tmp_path: Path) -> None:
    """The engine runs a failed step's chunks again (engine/isolation.py): a scored
    prompt's chunk run twice leaves the scores of one run, not two."""
    runner = _runner(write_tiny_model(tmp_path, "llama", tied=False))
    ids = tuple(range(1, 11))
    first = ChunkPlan(3, ids[:6], 0, _table(0), score_ids=ids[1:7], score_top=1)
    runner.step(StepPlan((first,)))
    runner.step(StepPlan((first,)))  # the step failed after scoring; it runs again
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    last = ChunkPlan(
        3,
        ids[6:],
        6,
        _table(0),
        samples=(SampleSpec(3, params, ids, ()),),
        score_ids=ids[7:],
        score_top=1,
    )
    (token,) = runner.step(StepPlan((last,)))
    assert token.prompt_logprobs is not None
    assert [s.token_id for s in token.prompt_logprobs] == list(ids[1:])
