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

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.runtime import step_inputs as step_inputs_module
from furnace_trio.runtime.attention import chunk_attention
from furnace_trio.runtime.layers import RMSNorm
from furnace_trio.runtime.quant import NativeQ4Linear, dequantize_q4, quantize_q4
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.runtime.step_inputs import PrefillBatch, build_inputs, chunk_mask

from .._model_fixtures import GEMMA3_WINDOW, write_tiny_model
from .model_helpers import (
    BLOCK,
    TOL,
    block_table,
    make_runner,
    ragged_decode,
    reference_logits,
    reference_model,
)


def test_prefill_then_decode_matches_transformers(
    tiny: tuple[ModelRunner, torch.nn.Module, int],
) -> None:
    runner, ref, vocab = tiny
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (23,), generator=gen).tolist()
    expected = reference_logits(ref, ids)
    table = block_table(0)
    prompt = 13  # crosses three block boundaries
    got = runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:prompt]), 0, table),)))
    torch.testing.assert_close(got[0], expected[prompt - 1], atol=TOL, rtol=TOL)
    for pos in range(prompt, len(ids)):
        got = runner.logits(StepPlan((ChunkPlan(1, (ids[pos],), pos, table),)))
        torch.testing.assert_close(got[0], expected[pos], atol=TOL, rtol=TOL)


def test_chunked_prefill_matches_whole(tiny: tuple[ModelRunner, torch.nn.Module, int]) -> None:
    runner, ref, vocab = tiny
    ids = torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = reference_logits(ref, ids)
    table = block_table(3)
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
    expected = [reference_logits(ref, s) for s in seqs]
    tables = [block_table(16 * i) for i in range(len(seqs))]
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
    ref = reference_model(path)
    vocab = load_hf_directory(path)[0].vocab_size
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (17, 9, 22, 5)]
    tables = [block_table(16 * i) for i in range(len(seqs))]
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
    rows = make_runner(path, native=False, kv_dtype=kv_dtype)
    batched = make_runner(path, native=False, kv_dtype=kv_dtype)
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
                expected = reference_logits(ref, full)[-1]
                torch.testing.assert_close(logits, expected, atol=TOL, rtol=TOL)


def test_prefill_batches_only_when_it_pays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill row is attended on its own; so are rows whose padded mask, or whose
    keys copied once per query head, would be too large."""
    plan = StepPlan(
        (ChunkPlan(0, (1, 2, 3), 0, block_table(0)), ChunkPlan(1, (4, 5), 0, block_table(16)))
    )
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
    expected = reference_logits(ref, ids)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_fused_decode_equals_per_op_path(tmp_path: Path, arch: str) -> None:
    """All-decode int8 steps run every layer in one native call; the per-op path (the same
    kernels called one by one from Python) must give bitwise the same logits, for ragged
    contexts and a bias (qwen2), and stay close to the float reference."""
    path = write_tiny_model(tmp_path, arch, tied=False, rope_llama3=False)
    runner = make_runner(path, quantization="int8")
    assert runner.model.kernels is not None
    assert runner.cache.k.dtype == torch.float16  # int8 with native kernels: half the KV bytes
    seqs, prompts, decodes = ragged_decode(runner.config.vocab_size)
    runner.logits(prompts)
    assert runner.model._decode_layer_ptrs(runner.cache, runner.model.kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    per_op = runner.logits(decodes)
    assert torch.equal(fused, per_op)
    ref = reference_logits(reference_model(path), seqs[1])[-1]
    assert float((fused[1] - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_q4_fused_decode_equals_per_op_path(tmp_path: Path, arch: str) -> None:
    """The 4-bit runtime on weights already on the 4-bit grid (as a Q4_1 file's): ``auto``
    turns every layer's linears into 4-bit ones, losslessly; the fused all-decode step equals
    the per-op path bitwise and stays close to the float runtime on the same weights (only
    activations are rounded, 8 bits per group of 32). qwen3 has q/k norms: its decode steps
    run the per-layer native path either way."""
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
    _, prompts, decodes = ragged_decode(config.vocab_size)
    runner.logits(prompts)
    reference.logits(prompts)
    kernels = runner.model.kernels
    assert kernels is not None  # the native layers, q/k norms included
    # q/k norms: the per-layer native path only; Llama-shaped layers also fuse
    assert runner.model._fusable == (arch != "qwen3")
    if arch != "qwen3":
        assert runner.model._decode_layer_ptrs(runner.cache, kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    assert torch.equal(fused, runner.logits(decodes))
    want = reference.logits(decodes)
    assert float((fused - want).norm() / want.norm()) < 0.03


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
    prompt = ChunkPlan(1, tuple(range(10)), 0, block_table(0))
    assert runner.logits(StepPlan((prompt,))).shape == (1, vocab)
    assert runner.prompt_logits(range(10), chunk=4).shape == (10, vocab)
    mixed = StepPlan(
        (
            ChunkPlan(1, (3,), 10, block_table(0), (SampleSpec(1, SamplingParams()),)),
            ChunkPlan(2, tuple(range(6)), 0, block_table(16)),
            ChunkPlan(3, (7, 8, 9), 4, block_table(32)),  # a chunk after cached tokens
            ChunkPlan(4, (5,), 20, block_table(48)),
        ),
        block_copies=((0, 60),),
    )
    runner.cache.copy_blocks(mixed.block_copies)
    assert runner.logits(mixed).shape == (4, vocab)
    decodes = StepPlan(tuple(ChunkPlan(s, (s,), 11 + s, block_table(16 * s)) for s in range(3)))
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


def test_gemma3_runs_the_native_layers_and_matches_the_torch_path(tmp_path: Path) -> None:
    """Gemma 3's q/k norms, sandwich norms, GELU gate, scaled embedding and sliding windows
    (window 6: the 13-token sequence's decode sees only its last 6) run through the native
    per-layer path, not the Llama-only fused call; its logits equal the torch path's to
    float32 rounding, at once and after prefill."""
    path = write_tiny_model(tmp_path, "gemma3", tied=True)
    native, torch_path = make_runner(path), make_runner(path, native=False)
    assert native.model.attends_natively and native.model.kernels is not None
    assert not native.model._fusable
    assert torch_path.model.kernels is None and not torch_path.model.attends_natively
    windows = [layer.self_attn.window for layer in native.model.layers]
    assert windows == [GEMMA3_WINDOW] * 5 + [None]
    seqs, prompts, decodes = ragged_decode(native.model.config.vocab_size)
    assert max(len(s) for s in seqs) > GEMMA3_WINDOW
    torch.testing.assert_close(
        native.logits(prompts), torch_path.logits(prompts), rtol=TOL, atol=TOL
    )
    torch.testing.assert_close(
        native.logits(decodes), torch_path.logits(decodes), rtol=TOL, atol=TOL
    )
