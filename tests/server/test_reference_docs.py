"""The generated pages of the manual are current and complete, and ``/docs`` serves the API
reference over a real socket.

``docs/configuration.md``, ``docs/api.md`` and ``docs/metrics.md`` are rendered by
``python -m furnace_trio.server.reference_docs``; when a test here fails after a change to
the settings or the routes, run that command (from the repository root, with
``PYTHONPATH=src``) and commit the pages.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import re
from pathlib import Path

import httpx

from furnace_trio.server import config_env, config_values
from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.config_reference import all_settings
from furnace_trio.server.reference_docs import PAGES, main
from furnace_trio.server.setting import settings_of

from ..http_server import serve_scripted

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SERVER = ROOT / "src" / "furnace_trio" / "server"
REGENERATE = "run `PYTHONPATH=src python -m furnace_trio.server.reference_docs` and commit"
VARIABLE = re.compile(r"\bFURNACE_[A-Z0-9_]*[A-Z0-9]\b")


def _shape(path: str) -> str:
    """A route with its parameters blanked: Quart's ``<path:id>`` and OpenAPI's ``{id}``
    alike become ``{}``."""
    return re.sub(r"<[^>]*>|\{[^}]*\}", "{}", path)


def test_generated_pages_are_current() -> None:
    for name, render in PAGES.items():
        current = (DOCS / name).read_text(encoding="utf-8")
        assert current == render(), f"docs/{name} is out of date: {REGENERATE}"


def test_every_field_of_the_config_has_a_setting_read_by_from_env() -> None:
    readers = inspect.getsource(config_env) + inspect.getsource(config_values)
    for field in dataclasses.fields(ServerConfig):
        records = settings_of(field)
        assert records, f"ServerConfig.{field.name} has no setting (furnace_trio.server.setting)"
        for record in records:
            assert record.doc.strip()
            if record.file_only:
                continue
            # the documented variable is the one the parser reads
            assert f'"{record.env}"' in readers, f"{record.env} is documented but never read"


def test_every_variable_in_the_config_code_is_in_the_manual() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (FURNACE_\w+)$", page, re.MULTILINE))
    sources = [SERVER / "config.py", *sorted(SERVER.glob("config_*.py"))]
    named = {v for path in sources for v in VARIABLE.findall(path.read_text(encoding="utf-8"))}
    assert named, "no FURNACE_* variable found in the config code"
    assert named <= headings, f"missing from docs/configuration.md: {sorted(named - headings)}"
    assert {record.env for _, record in all_settings() if not record.file_only} == headings


def test_every_route_of_the_app_is_in_the_api_reference() -> None:
    page = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = {
        (method, _shape(path))
        for method, path in re.findall(r"^### (GET|POST|PUT|PATCH|DELETE) `([^`]+)`$", page, re.M)
    }
    app = create_app(ServerConfig(device="cpu"))
    routes = {
        (method, _shape(rule.rule))
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    assert routes <= documented, f"missing from docs/api.md: {sorted(routes - documented)}"


def test_the_generator_writes_stale_pages_and_checks_them(tmp_path: Path) -> None:
    assert main(["--docs", str(tmp_path), "--check"]) == 1  # nothing there yet
    assert not list(tmp_path.iterdir())  # --check writes nothing
    assert main(["--docs", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    assert main(["--docs", str(tmp_path), "--check"]) == 0


def _documented_metrics() -> set[str]:
    page = (DOCS / "metrics.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(furnace_\w+)` \|", page, re.MULTILINE))


async def test_docs_page_renders_the_openapi_document_without_any_other_origin() -> None:
    async with (
        serve_scripted(api_key="docs-key") as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        page = await http.get("/docs")  # open, like /openapi.json
        document = (await http.get("/openapi.json")).json()
        metrics = (await http.get("/metrics")).text
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["x-content-type-options"] == "nosniff"
    policy = [p.strip() for p in page.headers["content-security-policy"].split(";")]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert not [p for p in policy if "unsafe" in p or "*" in p or "http" in p]
    body = page.text
    assert "<script" not in body.lower() and " src=" not in body
    # every link stays on this page or this server
    assert all(link.startswith(("#", "/")) for link in re.findall(r'href="([^"]*)"', body))
    for path, item in document["paths"].items():
        for method in item:
            if method in ("get", "post", "delete"):
                assert f"{method.upper()}</span> <code>{html.escape(path)}</code>" in body
    for name in document["components"]["schemas"]:
        assert f'id="schema-{name.lower()}"' in body
    # and the metrics page lists every series a live server describes
    served = set(re.findall(r"^# HELP (\w+) ", metrics, re.MULTILINE))
    assert served and served <= _documented_metrics(), sorted(served - _documented_metrics())
