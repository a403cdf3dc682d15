"""Sandboxed rendering of Hugging Face chat templates.

A chat template is Jinja2 source that ships with the model (``tokenizer_config.json``,
``chat_template.jinja`` or the GGUF's ``tokenizer.chat_template``). It is untrusted input:
it runs in :class:`~furnace_trio.text.template_sandbox.BoundedSandbox` (Jinja's immutable
sandbox), so it cannot reach Python internals (``''.__class__.__mro__``), mutate the
messages it is given, build huge strings, lists or ranges, or run past a CPU budget. The environment mirrors the one ``transformers`` uses
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``,
``strftime_now`` and a pass-through ``{% generation %}`` tag), so that a rendering here is
byte-identical to ``tokenizer.apply_chat_template(..., tokenize=False)``.

Every failure, whether at compile time (syntax), from the template itself
(``raise_exception``), from the sandbox, or from any Python error the template trips
over, surfaces as :class:`ChatTemplateError`, a ``ValueError``: the HTTP layer turns it
into a 400, and nothing a template does can crash the server.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from furnace_trio.text.template_sandbox import (
    MAX_REPEAT_RESULT,
    RENDER_CPU_S,
    BoundedSandbox,
    TemplateLimitError,
    bounded_template_ast,
    check_output,
    render_budget,
)

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message says why."""


class _TemplateRaisedError(Exception):
    """What ``raise_exception`` raises inside the template (converted at the boundary)."""


def _raise_exception(message: object) -> NoReturn:
    raise _TemplateRaisedError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's built-in tojson, no HTML escaping: this is the filter HF installs.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTagExtension(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    HF uses the tag to compute assistant-token masks for training; for inference it is a
    no-op, but templates that use it must still compile.
    """

    tags = {"generation"}  # noqa: RUF012 (the base class declares a plain set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _make_environment() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; render it as often as you like (it holds no state).

    Build it with :func:`compile_chat_template`, which caches by source text, so callers
    can hold the source string and still never compile the same template twice.
    """

    __slots__ = ("_template", "cpu_s", "source")

    def __init__(self, source: str, *, cpu_s: float = RENDER_CPU_S) -> None:
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("chat template must be a non-empty string")
        self.source = source
        self.cpu_s = cpu_s  # the CPU time one rendering may take
        try:
            env = _make_environment()
            self._template = env.from_string(bounded_template_ast(env, source))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from exc
        except Exception as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text (not tokenized, special tokens as text).

        The variables are the ones HF passes: ``messages``, ``tools`` (``None`` when absent),
        ``add_generation_prompt``, ``bos_token``/``eos_token`` and any extra keyword
        (``documents``, ``enable_thinking``...). Raises :class:`ChatTemplateError`.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise ChatTemplateError("messages must be a list of message objects")
        variables: dict[str, Any] = dict(kwargs)
        variables.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token if bos_token is not None else "",
            eos_token=eos_token if eos_token is not None else "",
        )
        try:
            with render_budget(self.cpu_s):
                return check_output(self._template.generate(**variables))
        except _TemplateRaisedError as exc:
            raise ChatTemplateError(str(exc)) from None
        except TemplateLimitError as exc:
            logger.warning("chat template stopped at a limit: %s", exc)
            raise ChatTemplateError(f"chat template exceeded a limit: {exc}") from None
        except jinja2.sandbox.SecurityError as exc:
            logger.warning("chat template blocked by the sandbox: %s", exc)
            raise ChatTemplateError(f"chat template tried an unsafe operation: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except Exception as exc:  # a template is untrusted code: any error is its failure
            raise ChatTemplateError(
                f"chat template failed to render: {type(exc).__name__}: {exc}"
            ) from None


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> ChatTemplate:
    """Compile ``source`` once; later calls with the same text return the same object."""
    return ChatTemplate(source)


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
    """Convenience: :func:`compile_chat_template` then :meth:`ChatTemplate.render`."""
    return compile_chat_template(source).render(messages, **kwargs)


__all__ = [
    "MAX_REPEAT_RESULT",
    "ChatTemplate",
    "ChatTemplateError",
    "compile_chat_template",
    "render_chat_template",
]
