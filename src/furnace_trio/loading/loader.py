"""One entry point for every model source: ``load_model(path) -> LoadedModel``.

``None`` means the embedded default (SmolLM2-135M-Instruct); a ``.gguf`` file goes through
:mod:`furnace_trio.loading.gguf_loader`; a directory through :mod:`furnace_trio.loading.hf_loader`. Either
way the weights are records over the memory-mapped file under Hugging Face Llama names
(:class:`~furnace_trio.loading.tensors.LazyWeights`), read one at a time when the runtime
builds the model, so the runtime never needs to know where a model came from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from furnace_trio.loading.default_model import (
    DEFAULT_MODEL_GENERATION,
    DEFAULT_MODEL_NAME,
    default_model_path,
)
from furnace_trio.loading.generation_defaults import (
    NO_GENERATION_DEFAULTS,
    GenerationDefaults,
    from_gguf_metadata,
    read_generation_config,
)
from furnace_trio.loading.gguf_loader import load_gguf, read_gguf
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.loading.model_config import ModelConfig, UnsupportedModelError
from furnace_trio.loading.tensors import LazyWeights

if TYPE_CHECKING:
    from furnace_trio.loading.tokenizer import Tokenizer

__all__ = ["LoadedModel", "load_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to serve: its config, weights, tokenizer and public name.

    ``name`` is what ``/v1/models`` lists: :data:`DEFAULT_MODEL_NAME` for the embedded
    default, else the directory name or the GGUF file's stem. ``source`` is the resolved
    path that was read. ``weights`` reads the file on demand (nothing is held in memory).
    ``generation`` holds the sampling defaults the model ships (see
    :mod:`~furnace_trio.loading.generation_defaults`).
    """

    name: str
    config: ModelConfig
    weights: LazyWeights
    tokenizer: Tokenizer
    source: Path
    generation: GenerationDefaults = NO_GENERATION_DEFAULTS


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory, or the default model when ``None``.

    Raises :class:`~furnace_trio.loading.default_model.DefaultModelMissingError` (with the install
    command) when the default is asked for but not installed, :class:`FileNotFoundError`
    for a path that does not exist, and :class:`UnsupportedModelError` for anything that is
    neither a ``.gguf`` file nor a directory, or a model outside the Llama family.
    """
    from furnace_trio.loading.tokenizer import (
        Tokenizer,  # another layer; imported late to keep this light
    )

    started = time.perf_counter()
    if path is None:
        source = default_model_path()
        name = DEFAULT_MODEL_NAME
    else:
        source = Path(path).expanduser().resolve()
        name = source.stem if source.is_file() else source.name
    if not source.exists():
        raise FileNotFoundError(f"model path {source} does not exist")
    if source.is_dir():
        config, weights = load_hf_directory(source)
        tokenizer = Tokenizer.from_hf_directory(source)
        generation = read_generation_config(source)
    elif source.is_file() and source.suffix.lower() == ".gguf":
        config, weights = load_gguf(source)
        # The tokenizer reads the same metadata; our header parser is much faster than
        # gguf.GGUFReader on a large vocabulary, so hand it the fields when it can take them.
        metadata = read_gguf(source).metadata
        tokenizer = Tokenizer.from_gguf_fields(
            {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
        )
        generation = from_gguf_metadata(metadata)
        if path is None and not generation.as_dict():
            generation = DEFAULT_MODEL_GENERATION
    else:
        raise UnsupportedModelError(
            f"{source}: expected a .gguf file or a Hugging Face model directory"
        )
    logger.info(
        "opened %s from %s in %.1fs (%d tensors, %.0f MiB)",
        name,
        source,
        time.perf_counter() - started,
        len(weights),
        weights.n_bytes / 2**20,
    )
    return LoadedModel(name, config, weights, tokenizer, source, generation)
