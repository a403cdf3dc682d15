"""The HTML page of ``GET /docs``: the OpenAPI document rendered on the server, once.

Plain HTML with one inline style sheet (allowed by its hash) and no script, built from the same records as
``docs/api.md`` (:mod:`furnace_trio.server.api_reference`), so it works without a network
(nothing is loaded from a CDN) and shows exactly the document ``/openapi.json`` serves.
Every string from the document is HTML-escaped.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Mapping
from typing import Any

from furnace_trio.server import api_reference
from furnace_trio.server.api_reference import anchor

_STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 72rem; margin: 2rem auto;
       padding: 0 1rem; color: #1d1d1f; }
code { font: 13px ui-monospace, monospace; background: #f2f2f5; padding: 0 .2em; }
table { border-collapse: collapse; margin: .5rem 0 1rem; width: 100%; }
th, td { border: 1px solid #d0d0d7; padding: .25rem .5rem; text-align: left;
         vertical-align: top; }
th { background: #f7f7fa; }
h3 { margin-top: 2rem; border-top: 1px solid #e0e0e6; padding-top: 1rem; }
.method { font-weight: bold; }
"""
#: Nothing but the page's own style sheet (by its hash): no script, no other origin, no
#: frame around the page.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()}'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class HtmlMarkup:
    def text(self, value: str) -> str:
        return html.escape(value)

    def code(self, value: str) -> str:
        return f"<code>{html.escape(value)}</code>"

    def schema_link(self, name: str) -> str:
        return f'<a href="#{anchor("schema", name)}">{html.escape(name)}</a>'


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows]
    return [*out, "</table>"]


def render_api_page(document: Mapping[str, Any]) -> str:
    """The whole page for ``document`` (an OpenAPI 3.1 document as a dict)."""
    markup = HtmlMarkup()
    esc = html.escape
    info = document.get("info", {})
    title = f"{info.get('title', 'API')} {info.get('version', '')}".strip()
    operations = api_reference.operations(document, markup)
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}: HTTP API</title><style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}: HTTP API</h1>",
        f"<p>{esc(info.get('description', ''))} The machine-readable document is "
        '<a href="/openapi.json">/openapi.json</a>; the chat page is <a href="/">/</a>.</p>',
        "<h2>Endpoints</h2>",
    ]
    out += _table(
        ("method", "path", "what"),
        [
            (
                f'<span class="method">{op.method}</span>',
                f'<a href="#{anchor("op", f"{op.method} {op.path}")}"><code>{esc(op.path)}'
                "</code></a>",
                esc(op.summary),
            )
            for op in operations
        ],
    )
    for op in operations:
        out.append(
            f'<h3 id="{anchor("op", f"{op.method} {op.path}")}"><span class="method">'
            f"{op.method}</span> <code>{esc(op.path)}</code></h3>"
        )
        out.append(f"<p>{esc(op.summary)}.</p>")
        if op.description:
            out.append(f"<p>{esc(op.description)}</p>")
        if op.parameters:
            out += _table(
                ("parameter", "type", "required", "notes"),
                [
                    (f"<code>{esc(p.name)}</code>", p.kind, _yes(p.required), p.notes)
                    for p in op.parameters
                ],
            )
        if op.request_body:
            out.append(f"<p>Request body (<code>application/json</code>): {op.request_body}.</p>")
        out += _table(
            ("status", "content", "description"),
            [
                (
                    esc(answer.status),
                    "<br>".join(
                        f"<code>{esc(media)}</code>: {kind}" for media, kind in answer.content
                    ),
                    esc(answer.description),
                )
                for answer in op.responses
            ],
        )
    out.append("<h2>Schemas</h2>")
    for schema in api_reference.schemas(document, markup):
        out.append(f'<h3 id="{anchor("schema", schema.name)}">{esc(schema.name)}</h3>')
        if schema.description:
            out.append(f"<p>{esc(schema.description)}</p>")
        if not schema.fields:
            out.append(f"<p>Type: {schema.kind}.</p>")
            continue
        out += _table(
            ("field", "type", "required", "notes"),
            [
                (f"<code>{esc(f.name)}</code>", f.kind, _yes(f.required), f.notes)
                for f in schema.fields
            ],
        )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
