"""MiMo's multi-token-prediction layer (runtime/mtp.py, runtime/mtp_draft.py) on a tiny
random checkpoint written by the test (tests/_mimo_fixtures.py).

The decoder's logits are transformers' Qwen2's; the MTP layer's output, run step by step
by the drafter as the server runs it (a prompt in two chunks, decode steps, drafted steps
whose drafts partly fail), equals a whole-sequence reference written from the
checkpoint's modeling code with transformers' Qwen2 modules; drafts from it leave the
greedy tokens as they are without speculation; an echoing model's drafts all hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampledToken, SampleSpec, StepPlan
from furnace_trio.loading.hf_loader import config_from_hf, load_hf_directory
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.runtime.mtp_draft import MTPDrafter
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

from .._mimo_fixtures import reference_model, reference_mtp_logits, write_tiny_mimo
from .._model_fixtures import write_tiny_model

BLOCK = 4
TABLE = tuple(range(24))
GREEDY = SamplingParams(temperature=0.0)


def _runner(path: Path, **settings: object) -> ModelRunner:
    config, weights = load_hf_directory(path)
    defaults: dict[str, object] = dict(device="cpu", kv_cache_bytes=1 << 22, block_size=BLOCK)
    return ModelRunner(config, weights, RunnerConfig(**{**defaults, **settings}))  # type: ignore[arg-type]


def _prompt(n: int = 12, seed: int = 1) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunk(seq: list[int], prompt: int, drafts: int = 0) -> ChunkPlan:
    """The decode chunk of ``seq`` (its first ``prompt`` tokens the prompt) with
    ``drafts`` placeholders (the last token repeated) after its last token."""
    spec = SampleSpec(1, GREEDY, tuple(seq[:prompt]), tuple(seq[prompt:]))
    tokens = (seq[-1],) * (1 + drafts)
    return ChunkPlan(1, tokens, len(seq) - 1, TABLE, samples=(spec,), num_drafts=drafts)


def _prefill(runner: ModelRunner, prompt: list[int], split: int) -> list[SampledToken]:
    """The prompt in two chunks, the first without samples (its last position waits)."""
    runner.step(StepPlan((ChunkPlan(1, tuple(prompt[:split]), 0, TABLE),)))
    spec = SampleSpec(1, GREEDY, tuple(prompt), ())
    last = ChunkPlan(1, tuple(prompt[split:]), split, TABLE, samples=(spec,))
    return runner.step(StepPlan((last,)))


def test_a_mimo_config_is_qwen2_with_an_mtp_layer(tmp_path: Path) -> None:
    directory = write_tiny_mimo(tmp_path)
    config, weights = load_hf_directory(directory)
    assert (config.architecture, config.mtp_layers, config.attention_bias) == ("qwen2", 1, True)
    assert "model.mtp_layers.0.input_proj.weight" in weights
    raw = {"model_type": "mimo", "num_nextn_predict_layers": 1, "hidden_size": 64}
    raw |= {"num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96}
    assert config_from_hf({**raw, "vocab_size": 320}).mtp_layers == 1
    # a config that names MTP layers over weights without them: none
    plain = write_tiny_model(tmp_path, "qwen2", tied=False)
    assert load_hf_directory(plain)[0].mtp_layers == 0


def test_without_speculation_the_mtp_weights_stay_unread(tmp_path: Path) -> None:
    directory = write_tiny_mimo(tmp_path)
    runner = _runner(directory, quantization="none")
    assert runner.model.mtp is None and runner.mtp_cache is None
    ids = _prompt()
    logits = runner.logits(StepPlan((ChunkPlan(1, tuple(ids), 0, TABLE),)))[0]
    with torch.no_grad():
        expected = reference_model(directory)(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)


def test_a_model_without_mtp_layers_is_refused(tmp_path: Path) -> None:
    plain = write_tiny_model(tmp_path, "qwen2", tied=False)
    with pytest.raises(UnsupportedModelError, match="multi-token-prediction"):
        _runner(plain, mtp=True)


@pytest.mark.parametrize(
    ("quantization", "native", "tolerance"),
    [("none", True, 1e-5), ("none", False, 1e-5), ("int8", True, 0.05)],
)
def test_the_mtp_layer_matches_the_reference_step_by_step(
    tmp_path: Path, quantization: str, native: bool, tolerance: float
) -> None:
    """After every step the drafter keeps the layer's output at the sequence's last
    position; its logits equal the reference's there, through a prompt in two chunks,
    plain decode steps and drafted steps (with the drafter's own proposals, of which a
    random model keeps few: the rejected positions must leave no trace), on the native
    float32 path and on torch's."""
    directory = write_tiny_mimo(tmp_path)
    reference = reference_model(directory)
    runner = _runner(directory, quantization=quantization, native=native, mtp=True)
    assert (runner.model.kernels is not None) == native  # the native path, or torch's
    drafter = MTPDrafter(runner)
    runner.drafter = drafter
    prompt = _prompt()
    seq = [*prompt, _prefill(runner, prompt, split=5)[0].token_id]
    proposed = 0
    for step in range(8):
        ready = drafter._ready[1]
        assert ready.position == len(seq) - 2 and ready.token == seq[-1]
        with torch.inference_mode():
            mine = runner.model.lm_head(ready.out[None]).float()[0]
        expected = reference_mtp_logits(directory, reference, seq)[ready.position]
        torch.testing.assert_close(mine, expected, atol=tolerance, rtol=0)
        tokens = runner.step(StepPlan((_chunk(seq, len(prompt), drafts=3 if step % 2 else 0),)))
        proposed += len(tokens[0].proposed)
        seq.extend(t.token_id for t in tokens)
    assert proposed == 12  # four drafted steps, three drafts each, all proposed by the layer
    with torch.no_grad():
        logits = reference(torch.tensor([seq])).logits[0]
    assert seq[len(prompt) :] == logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


def _generate(runner: ModelRunner, prompt: list[int], steps: int, drafts: int) -> list[int]:
    seq = [*prompt, _prefill(runner, prompt, split=7)[0].token_id]
    for _ in range(steps):
        seq.extend(t.token_id for t in runner.step(StepPlan((_chunk(seq, len(prompt), drafts),))))
    return seq[len(prompt) :]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_mtp_drafts_leave_greedy_tokens_as_they_are(tmp_path: Path, quantization: str) -> None:
    directory = write_tiny_mimo(tmp_path)
    prompt = _prompt(10, seed=3)
    plain = _generate(_runner(directory, quantization=quantization), prompt, 12, 0)
    runner = _runner(directory, quantization=quantization, mtp=True)
    runner.drafter = MTPDrafter(runner)
    drafted = _generate(runner, prompt, 12, 3)
    assert drafted[: len(plain)] == plain
    assert len(drafted) >= len(plain)


def test_an_echoing_models_drafts_all_hold(tmp_path: Path) -> None:
    """The echo model repeats its last token and its MTP layer predicts that: every draft
    holds, so each drafted step returns its drafts and one token more."""
    directory = write_tiny_mimo(tmp_path, echo=True)
    runner = _runner(directory, quantization="none", mtp=True)
    runner.drafter = MTPDrafter(runner)
    prompt = _prompt(9, seed=5)
    seq = [*prompt, _prefill(runner, prompt, split=4)[0].token_id]
    assert seq[-1] == prompt[-1]
    for _ in range(3):
        tokens = runner.step(StepPlan((_chunk(seq, len(prompt), drafts=3),)))
        assert len(tokens) == 4 and tokens[0].proposed == (prompt[-1],) * 3
        seq.extend(t.token_id for t in tokens)
    assert seq[len(prompt) :] == [prompt[-1]] * 13


def test_released_sequences_are_forgotten(tmp_path: Path) -> None:
    directory = write_tiny_mimo(tmp_path)
    runner = _runner(directory, quantization="none", mtp=True)
    drafter = MTPDrafter(runner)
    runner.drafter = drafter
    prompt = _prompt(9)
    runner.step(StepPlan((ChunkPlan(1, tuple(prompt[:5]), 0, TABLE),)))
    assert drafter.num_sequences == 1  # the first chunk's last position waits
    runner.step(StepPlan((), released=(1,)))
    assert drafter.num_sequences == 0
