"""Phi-3 and the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers.

Tiny random models written by the test (:mod:`tests._arch_fixtures`): logits of a prefill
and of decode steps equal transformers' on the float path, with and without the native
CPU kernels; a ragged batch of several sequences (the experts batched across them) equals
each sequence alone; greedy generation through :meth:`ModelRunner.step` gives
transformers' own greedy tokens; the per-expert counts are transformers' router choices.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.loading.hf_loader import config_from_hf, load_hf_directory
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.runtime.moe import SparseMoE
from furnace_trio.runtime.quant import NativeLinear
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

from .._arch_fixtures import ARCHES, write_arch_gguf, write_arch_model

BLOCK = 4
TOL = 2e-5
MOE = ("mixtral", "qwen2moe", "qwen3moe")


def _runner(path: Path, **settings: object) -> ModelRunner:
    config, weights = load_gguf(path) if path.suffix == ".gguf" else load_hf_directory(path)
    defaults: dict[str, object] = dict(device="cpu", kv_cache_bytes=1 << 22, block_size=BLOCK)
    return ModelRunner(config, weights, RunnerConfig(**{**defaults, **settings}))  # type: ignore[arg-type]


def _reference(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _table(first: int, n: int = 16) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def _prefill_then_decode(runner: ModelRunner, ids: list[int], prompt: int) -> list[torch.Tensor]:
    table = _table(0)
    out = [runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:prompt]), 0, table),)))[0]]
    for pos in range(prompt, len(ids)):
        out.append(runner.logits(StepPlan((ChunkPlan(1, (ids[pos],), pos, table),)))[0])
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(ARCHES))
def test_prefill_then_decode_matches_transformers(tmp_path: Path, name: str, native: bool) -> None:
    """23 tokens: past the window of ``phi3-window`` (6) and past LongRoPE's original
    context (16), where transformers takes the long factors for the whole sequence, as a
    runner whose context exceeds the original one does for every sequence."""
    path = write_arch_model(tmp_path, name)
    runner = _runner(path, native=native)
    ids = _ids(23, 1)
    expected = _ref_logits(_reference(path), ids)
    got = _prefill_then_decode(runner, ids, 13)
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, expected[12 + i], atol=TOL, rtol=TOL)


def test_longrope_takes_the_short_factors_within_the_original_context(tmp_path: Path) -> None:
    """Served with a context no longer than the original one, every position is rotated
    with the short factors: what transformers computes for a sequence that short."""
    path = write_arch_model(tmp_path, "phi3-longrope")
    runner = _runner(path, max_context=16)
    assert runner.config.longrope is not None and not runner.config.longrope.long
    ids = _ids(16, 3)
    expected = _ref_logits(_reference(path), ids)
    got = _prefill_then_decode(runner, ids, 9)
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, expected[8 + i], atol=TOL, rtol=TOL)
    long = _runner(path)
    assert long.config.longrope is not None and long.config.longrope.long
    assert not torch.allclose(
        long.logits(StepPlan((ChunkPlan(1, tuple(ids), 0, _table(0)),)))[0], expected[-1]
    )


@pytest.mark.parametrize("name", [*MOE, "phi3-window"])
def test_a_ragged_batch_equals_each_sequence_alone(tmp_path: Path, name: str) -> None:
    """Prefills and decodes of three sequences in one step: each token's experts run in
    the same per-expert batches as the others', and its logits are its own."""
    path = write_arch_model(tmp_path, name)
    runner = _runner(path)
    ref = _reference(path)
    seqs = [_ids(n, seed) for n, seed in ((9, 4), (5, 5), (12, 6))]
    plan = StepPlan(
        tuple(ChunkPlan(i, tuple(s[:-1]), 0, _table(16 * i)) for i, s in enumerate(seqs))
    )
    first = runner.logits(plan)
    mixed = StepPlan(
        (
            ChunkPlan(0, (seqs[0][-1],), len(seqs[0]) - 1, _table(0)),
            ChunkPlan(1, (seqs[1][-1],), len(seqs[1]) - 1, _table(16)),
            ChunkPlan(3, tuple(seqs[2]), 0, _table(48)),
        )
    )
    second = runner.logits(mixed)
    for i, s in enumerate(seqs):
        expected = _ref_logits(ref, s)
        torch.testing.assert_close(first[i], expected[-2], atol=TOL, rtol=TOL)
        torch.testing.assert_close(second[i], expected[-1], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ["phi3", "mixtral", "qwen2moe", "qwen3moe"])
def test_greedy_generation_through_the_runner_is_transformers_greedy(
    tmp_path: Path, name: str
) -> None:
    path = write_arch_model(tmp_path, name)
    runner = _runner(path)
    prompt = _ids(7, 7)
    with torch.no_grad():
        ref = (
            _reference(path)
            .generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10
            )[0, len(prompt) :]
            .tolist()
        )
    params = SamplingParams(temperature=0.0)
    tokens: list[int] = []
    chunk = tuple(prompt)
    pos = 0
    while len(tokens) < 10:
        spec = SampleSpec(1, params, tuple(prompt), tuple(tokens))
        (sampled,) = runner.step(StepPlan((ChunkPlan(1, chunk, pos, _table(0), (spec,)),)))
        pos += len(chunk)
        tokens.append(sampled.token_id)
        chunk = (sampled.token_id,)
    assert tokens == ref


@pytest.mark.parametrize("name", MOE)
def test_expert_counts_are_the_routers_choices(tmp_path: Path, name: str) -> None:
    """After served steps, tokens per (layer, expert) are what transformers' routers chose
    for the same tokens; dense layers count nothing; logits() (warm-up, tests) counts
    nothing."""
    path = write_arch_model(tmp_path, name)
    runner = _runner(path)
    ref = _reference(path)
    chosen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(ref.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(
                lambda _m, _a, out, i=i: chosen.__setitem__(i, out[2].reshape(-1))
            )
    ids = _ids(11, 8)
    _ref_logits(ref, ids)
    runner.logits(StepPlan((ChunkPlan(9, tuple(ids), 0, _table(0)),)))
    assert not any(any(row) for row in runner.expert_tokens())
    spec = SampleSpec(1, SamplingParams(temperature=0.0))
    runner.step(StepPlan((ChunkPlan(1, tuple(ids[:6]), 0, _table(0), (spec,)),)))
    runner.step(StepPlan((ChunkPlan(1, tuple(ids[6:]), 6, _table(0), (spec,)),)))
    counts = runner.expert_tokens()
    config = runner.config
    assert config.moe is not None
    assert len(counts) == config.num_layers
    for i, row in enumerate(counts):
        if not config.sparse(i):
            assert row == () and i not in chosen
            continue
        expected = torch.bincount(chosen[i], minlength=config.moe.num_experts).tolist()
        assert list(row) == expected
        assert sum(row) == len(ids) * config.moe.top_k


@pytest.mark.parametrize(
    ("name", "quantization", "qtype"),
    [
        ("mixtral", "int8", None),
        ("qwen3moe", "q4", None),
        ("qwen3moe", "auto", gguf.GGMLQuantizationType.Q8_0),
        ("mixtral", "auto", gguf.GGMLQuantizationType.Q4_0),
        ("phi3", "auto", gguf.GGMLQuantizationType.Q8_0),
    ],
)
def test_quantized_experts_are_native_linears_close_to_the_reference(
    tmp_path: Path, name: str, quantization: str, qtype: gguf.GGMLQuantizationType | None
) -> None:
    """Under ``FURNACE_QUANT`` every expert is a native quantized linear (a GGUF's blocks
    kept as they are under ``auto``); the logits stay close to float32's on the same
    (dequantized) weights, and greedy picks agree."""
    directory, path = write_arch_gguf(tmp_path, name, qtype)
    source = directory if qtype is None else path
    runner = _runner(source, quantization=quantization)
    float_runner = _runner(source)
    moe = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert (len(moe) > 0) == (name != "phi3")
    for layer in moe:
        for expert in layer.experts:
            assert isinstance(expert.gate_up_proj, NativeLinear)
            assert isinstance(expert.down_proj, NativeLinear)
    ids = _ids(14, 9)
    plan = StepPlan((ChunkPlan(1, tuple(ids), 0, _table(0)),))
    got, want = runner.logits(plan)[0], float_runner.logits(plan)[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99
    assert got.argmax() == want.argmax()


def test_unsupported_phi3_variants_say_why() -> None:
    base = {
        "model_type": "phi3",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    }
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        config_from_hf({**base, "partial_rotary_factor": 0.75})
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        config_from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    longrope = {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}
    with pytest.raises(UnsupportedModelError, match="LongRoPE needs 8 factors"):
        config_from_hf({**base, "original_max_position_embeddings": 16, "rope_scaling": longrope})
