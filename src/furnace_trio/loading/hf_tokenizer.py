"""A Hugging Face model directory's tokenizer files, read into :class:`TokenizerParts`.

``tokenizer.json`` as is; ``tokenizer_config.json`` for BOS/EOS, ``add_bos_token``, added
tokens and the chat template (a ``chat_template.jinja`` file, else ``chat_template.json``,
overrides it); ``generation_config.json`` for extra EOS ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.tokenizer_parts import TokenizerParts

logger = logging.getLogger(__name__)


def read_hf_tokenizer(path: str | Path) -> TokenizerParts:
    """The tokenizer of the Hugging Face model directory ``path``: ``tokenizer.json`` (+
    ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json`` when
    present)."""
    root = Path(path)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UnsupportedModelError(f"{root} has no tokenizer.json")
    try:
        hf = HFTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception on bad files
        raise UnsupportedModelError(f"cannot load {tokenizer_file}: {exc}") from exc

    config_file = root / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    _add_config_tokens(hf, config.get("added_tokens_decoder"))

    def token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        return hf.token_to_id(content) if content is not None else None

    bos_token_id = token_id("bos_token")
    eos_token_id = token_id("eos_token")
    extra_eos: list[int] = []
    generation_file = root / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
        extra_eos = _int_ids(generation.get("eos_token_id"))
        if bos_token_id is None:
            bos_ids = _int_ids(generation.get("bos_token_id"))
            bos_token_id = bos_ids[0] if bos_ids else None
        if eos_token_id is None and extra_eos:
            eos_token_id = extra_eos[0]

    chat_template = _pick_chat_template(config.get("chat_template"))
    jinja_file = root / "chat_template.jinja"
    json_template_file = root / "chat_template.json"
    if jinja_file.is_file():
        chat_template = jinja_file.read_text(encoding="utf-8")
    elif json_template_file.is_file():
        chat_template = (
            _pick_chat_template(_read_json(json_template_file).get("chat_template"))
            or chat_template
        )

    add_bos = config.get("add_bos_token")
    probe = hf.encode("", add_special_tokens=True).ids
    post_adds_bos = bool(probe) and probe[0] == bos_token_id
    return TokenizerParts(
        hf,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        extra_eos_token_ids=tuple(extra_eos),
        # Unset: trust tokenizer.json's post-processor, as transformers does.
        add_bos_token=post_adds_bos if add_bos is None else bool(add_bos),
        chat_template=chat_template,
    )


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} does not hold a JSON object")
    return data


def _pick_chat_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (use "default")."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {
            item["name"]: item["template"]
            for item in value
            if isinstance(item, Mapping) and isinstance(item.get("template"), str)
        }
        return named.get("default") or next(iter(named.values()), None)
    return None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _add_config_tokens(hf: HFTokenizer, added_tokens_decoder: Any) -> None:
    """Make sure tokens listed in tokenizer_config.json's ``added_tokens_decoder`` match
    whole (tokenizer.json normally lists them already; older exports sometimes do not)."""
    if not isinstance(added_tokens_decoder, Mapping):
        return
    known = {t.content for t in hf.get_added_tokens_decoder().values()}
    for raw_id, spec in added_tokens_decoder.items():
        content = _token_content(spec)
        if content is None or content in known:
            continue
        special = bool(spec.get("special", True)) if isinstance(spec, Mapping) else True
        token = AddedToken(content, special=special, normalized=False)
        if special:
            hf.add_special_tokens([token])
        else:
            hf.add_tokens([token])
        got = hf.token_to_id(content)
        if str(got) != str(raw_id):
            logger.warning("added token %r got id %s, config says %s", content, got, raw_id)
