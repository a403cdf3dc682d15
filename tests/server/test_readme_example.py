"""The README's first example, run as written: its Python block is taken from README.md
(only the server's URL is swapped) and executed with the official SDK against the server's
real loading path and the default model, at the defaults that model gets."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import trio

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig

from ..http_server import serve_app
from ..real_model import default_model

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000/v1"
#: What makes the answer sensible: the README's question is water's boiling point.
KEYWORD = "100"


def _first_example() -> tuple[str, str]:
    """The first ``python`` block of the README and the ``text`` block after it (the
    output the README shows)."""
    text = README.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert code is not None, "README.md has no python example"
    shown = re.compile(r"```text\n(.*?)```", re.DOTALL).search(text, code.end())
    assert shown is not None, "README.md shows no output for its first example"
    return code.group(1), shown.group(1).strip()


def _request_fields(code: str) -> dict[str, Any]:
    """The keyword arguments of the example's ``create(...)`` call, as literals."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "create":
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    raise AssertionError("the README example makes no create() call")


def _record(printed: list[str], *args: object) -> None:
    printed.append(" ".join(map(str, args)))


def test_the_example_asks_for_a_bounded_answer() -> None:
    code, shown = _first_example()
    fields = _request_fields(code)
    assert isinstance(fields.get("max_tokens"), int), "the first example must set max_tokens"
    assert "temperature" not in fields  # it shows the defaults a new user gets
    assert README_URL in code
    assert KEYWORD in shown


async def test_the_readme_example_answers_sensibly_with_the_default_model() -> None:
    code, _ = _first_example()
    max_tokens = _request_fields(code)["max_tokens"]
    default_model()  # skips without the default model
    app = create_app(ServerConfig(device="cpu", kv_cache_mb=16))
    async with serve_app(app) as url:
        # Twice: the second run finds the prompt in the prefix cache.
        for _ in range(2):
            printed: list[str] = []
            namespace: dict[str, Any] = {"print": functools.partial(_record, printed)}
            example = code.replace(README_URL, f"{url}/v1")
            await trio.to_thread.run_sync(exec, example, namespace)
            reply = namespace["reply"]
            (answer,) = printed
            assert KEYWORD in answer and "Celsius" in answer, answer
            # as the README says: "stop" before max_tokens, or "length" exactly at it
            finish, used = reply.choices[0].finish_reason, reply.usage.completion_tokens
            assert (finish, used < max_tokens) in (("stop", True), ("length", False)), answer
            assert used <= max_tokens
