"""The draft model (runtime/draft.py) over the real default model: its proposals after a
rejection, after full acceptance, and with its prompt caught up a piece at a time are those
of a draft model that starts from nothing; released sequences give back every block."""

from __future__ import annotations

import pytest

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runtime import draft as draft_module
from furnace_trio.runtime.draft import DraftModel, check_vocabulary

from ..real_model import default_model, default_runner

pytestmark = pytest.mark.model

K = 4


def _plan(prompt: tuple[int, ...], context: tuple[int, ...]) -> StepPlan:
    """A decode chunk of ``context`` (its last token and ``K`` placeholder drafts)."""
    spec = SampleSpec(0, SamplingParams(temperature=0), prompt, context[len(prompt) :])
    table = tuple(range(-(-(len(context) + K) // 16)))
    chunk = ChunkPlan(0, (context[-1],) * (K + 1), len(context) - 1, table, (spec,), num_drafts=K)
    return StepPlan((chunk,))


def _proposals(
    draft: DraftModel, prompt: tuple[int, ...], context: tuple[int, ...]
) -> tuple[int, ...]:
    return draft.fill(_plan(prompt, context)).chunks[0].draft_token_ids


def test_proposals_do_not_depend_on_what_the_cache_held(monkeypatch: pytest.MonkeyPatch) -> None:
    model = default_model()
    check_vocabulary(model, model)
    tok = model.tokenizer
    text = "List the planets of the solar system in order from the sun, with one fact each."
    prompt = tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
    vocab = model.config.vocab_size
    kept = DraftModel(default_runner(16), vocab)
    fresh = DraftModel(default_runner(16), vocab)

    def reference(context: tuple[int, ...]) -> tuple[int, ...]:
        out = _proposals(fresh, prompt, context)
        fresh.release([0])
        return out

    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 7)  # the prompt in pieces
    first = _proposals(kept, prompt, prompt)
    monkeypatch.undo()
    assert first == reference(prompt)
    # two drafts accepted, the third rejected for another token
    other = next(t for t in range(100, 200) if t != first[2])
    context = (*prompt, *first[:2], other)
    second = _proposals(kept, prompt, context)
    assert second == reference(context)
    # every draft accepted, and the served model's own token after them
    context = (*context, *second, second[0])
    assert _proposals(kept, prompt, context) == reference(context)
    assert kept.num_sequences == 1
    kept.release([0])
    assert (kept.num_sequences, kept.num_free_blocks) == (0, kept.runner.num_blocks)
