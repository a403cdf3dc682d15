"""A step's inputs: chunks flattened into rows, short chunks run as one-token rows of the
decode path, and the rotary table as it grows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runtime.step_inputs import build_inputs

from .._model_fixtures import write_tiny_model
from .model_helpers import (
    BLOCK,
    block_table,
    make_runner,
)


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
    runner = make_runner(path, quantization=quantization)  # short chunks as rows: the default
    chunk_path = make_runner(path, quantization=quantization, split_chunks_upto=0)
    ids = torch.randint(
        0, runner.config.vocab_size, (28,), generator=torch.Generator().manual_seed(9)
    )
    prefix, tail = tuple(ids[:20].tolist()), tuple(ids[20:].tolist())
    got = {}
    for name, r, first in (("rows", runner, 0), ("steps", runner, 16), ("chunk", chunk_path, 0)):
        r.logits(StepPlan((ChunkPlan(1, prefix, 0, block_table(first)),)))
        if name == "steps":
            for i, token in enumerate(tail):
                step = StepPlan((ChunkPlan(1, (token,), len(prefix) + i, block_table(first)),))
                got[name] = r.logits(step)[0]
        else:
            got[name] = r.logits(StepPlan((ChunkPlan(1, tail, len(prefix), block_table(first)),)))[
                0
            ]
    assert torch.equal(got["rows"], got["steps"])
    # Not bitwise: the chunk path attends over float32 keys of a fresh prompt and reads the
    # cache otherwise; the activations' rounding to int8 per group moves the rest.
    rel = float((got["rows"] - got["chunk"]).norm() / got["chunk"].norm())
    assert rel < 2e-2
    assert int(got["rows"].argmax()) == int(got["chunk"].argmax())


def test_rotary_rows_match_the_formula_as_the_table_grows(tmp_path: Path) -> None:
    """cos/sin rows come from a table grown on demand (by doubling); each row is what the
    rotary formula gives for that position, and a shorter step reuses the table."""
    runner = make_runner(write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=True))
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
