"""``FURNACE_SPECULATIVE=mtp``: a tiny MiMo checkpoint (tests/_mimo_fixtures.py) drafting
from its own multi-token-prediction layer. Greedy tokens are those of the same model
without speculation (a random MTP layer, whose drafts mostly fail); over the socket with
the official client an echoing model's drafts all hold and the metrics count them; a
model without MTP layers is refused at startup, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.server.backend import load_backend
from furnace_trio.server.config import ServerConfig

from .._mimo_fixtures import write_tiny_mimo
from ..real_model import default_model
from .test_speculative import _answers, spec_counts
from .test_speculative_draft import _greedy


def _config(model: Path, speculative: str) -> ServerConfig:
    return ServerConfig(model=str(model), device="cpu", kv_cache_mb=4, speculative=speculative)


async def test_mtp_drafts_leave_the_greedy_tokens_as_they_are(tmp_path: Path) -> None:
    mimo = write_tiny_mimo(tmp_path)
    prompts = [(5, 6, 7, 8, 9, 10), (40, 41, 42), tuple(range(100, 140))]
    results = []
    for speculative in ("off", "mtp"):
        backend = await trio.to_thread.run_sync(load_backend, _config(mimo, speculative))
        results.append(await _greedy(backend, prompts))
    (plain, _), (drafting, drafted) = results
    assert drafting == plain
    assert all(len(t) == 24 for t in plain)
    assert drafted > 0


async def test_an_echoing_models_drafts_hold_over_the_socket(tmp_path: Path) -> None:
    """The official client's greedy requests (stop strings, ``max_tokens``, logprobs,
    ``n = 2``, streaming) answered as without speculation, every draft held."""
    mimo = write_tiny_mimo(tmp_path, echo=True)
    plain, plain_stream, _ = await _answers(_config(mimo, "off"))
    spec, spec_stream, metrics = await _answers(_config(mimo, "mtp"))
    assert spec == plain
    assert "".join(spec_stream) == "".join(plain_stream) == plain[0][0][0] != ""
    counts = spec_counts(metrics)
    drafted = counts["furnace_spec_drafted_tokens_total"]
    assert drafted > 0
    assert counts["furnace_spec_accepted_tokens_total"] == drafted


@pytest.mark.model
def test_a_model_without_mtp_layers_is_refused() -> None:
    default_model()
    with pytest.raises(UnsupportedModelError) as refused:
        load_backend(ServerConfig(device="cpu", kv_cache_mb=8, speculative="mtp"))
    message = str(refused.value)
    assert "SmolLM2-135M-Instruct" in message and "multi-token-prediction" in message


def test_the_setting() -> None:
    assert ServerConfig.from_env({"FURNACE_SPECULATIVE": "MTP"}).speculative == "mtp"
