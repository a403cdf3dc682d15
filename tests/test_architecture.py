"""The import contract: the folders of ``src/furnace_trio`` are layers, and imports flow down.

    server -> engine -> tools -> loading -> text -> core
    server -> runtime -> loading

The engine runs the scheduler and streams in plain Python on Trio: it reaches the model only
through :class:`furnace_trio.core.plan.StepRunner`, so it imports neither torch nor the
runtime. Nothing below the server imports anything HTTP. No Python file (module, test,
benchmark or script) is over :data:`MAX_LINES` lines, and ``docs/architecture.md`` names
every module in its layer's section. ``nox -s lint`` runs this file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "furnace_trio"

#: Each layer and the layers of this package it may import (itself included).
ALLOWED: dict[str, set[str]] = {
    "server": {"server", "engine", "runtime", "loading", "tools", "text", "core"},
    "engine": {"engine", "tools", "loading", "text", "core"},
    "runtime": {"runtime", "loading", "text", "core"},
    "loading": {"loading", "text", "core"},
    "tools": {"tools", "loading", "text", "core"},
    "text": {"text", "core"},
    "core": {"core"},
}
HTTP = {"quart", "quart_trio", "hypercorn", "h11", "h2", "httpx", "werkzeug"}
TORCH = {"torch"}
#: Third-party packages a layer must not import.
FORBIDDEN: dict[str, set[str]] = {
    "server": set(),
    "engine": HTTP | TORCH,
    "runtime": HTTP,
    "loading": HTTP,
    "tools": HTTP | TORCH,
    "text": HTTP | TORCH,
    "core": HTTP | TORCH,
}


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def layer_of(path: Path) -> str | None:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else None


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, functions' own included."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("furnace_trio", *path.relative_to(SRC).parts[:-1]))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def test_every_module_lives_in_a_layer() -> None:
    top = {p.name for p in SRC.glob("*.py")}
    assert top == {"__init__.py", "app.py"}, "modules belong in a layer's folder"
    assert {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ALLOWED)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_flow_down(path: Path) -> None:
    layer = layer_of(path)
    if layer is None:
        return
    wrong = []
    for line, name in imported(path):
        parts = name.split(".")
        if parts[0] == "furnace_trio":
            if len(parts) > 1 and parts[1] in ALLOWED and parts[1] not in ALLOWED[layer]:
                wrong.append(f"line {line}: {name}")
        elif parts[0] in FORBIDDEN[layer]:
            wrong.append(f"line {line}: {name}")
    assert not wrong, f"{layer} may not import: {wrong}"


def test_the_walker_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    """An import inside a function and a relative one are both found, so neither can slip
    past the contract."""
    sample = SRC / "engine" / "_contract_probe.py"
    sample.write_text("from .scheduler import Scheduler\n\ndef f():\n    import torch\n")
    try:
        names = [name for _, name in imported(sample)]
    finally:
        sample.unlink()
    assert names == ["furnace_trio.engine.scheduler", "torch"]


#: The most lines a module may have: one concept per file.
MAX_LINES = 500


ROOT = SRC.parent.parent


def python_files() -> list[Path]:
    """Every Python file of the repository that is ours: the package, the tests, the
    benchmarks, the deployment scripts and the noxfile."""
    found = [ROOT / "noxfile.py"]
    for folder in ("src", "tests", "benchmarks", "deploy"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return found


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_python_file_is_over_the_line_limit(path: Path) -> None:
    name = path.relative_to(ROOT).as_posix()
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept"


ARCHITECTURE = SRC.parent.parent / "docs" / "architecture.md"


def layer_sections() -> dict[str, str]:
    """Each layer's section of ``docs/architecture.md`` (``### <layer>: ...`` under
    ``## Modules``), by layer name."""
    modules_part = ARCHITECTURE.read_text().split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### ", modules_part, flags=re.MULTILINE)[1:]
    return {section.split(":", 1)[0]: section for section in sections}


@pytest.mark.parametrize(
    "path",
    [p for p in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.c")]) if p.name != "__init__.py"],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_the_architecture_page_names_every_module(path: Path) -> None:
    layer = layer_of(path)
    if layer is None:
        return
    section = layer_sections().get(layer, "")
    stem = path.stem
    named = path.name in section or f"`{stem}`" in section
    assert named, f"docs/architecture.md does not name {path.relative_to(SRC)} under {layer}"
