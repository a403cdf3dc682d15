"""The chat page at ``/`` and its files, over a real socket (the page in a real browser is
``tests/browser/``, ``nox -s browser``).

The page is served with a Content-Security-Policy of this origin only, its files with
their content types and ``nosniff``, and it loads nothing from elsewhere. Its script
writes what the server sends as text only, which the browser test checks in the DOM; here
the source is checked for every way of writing HTML.
"""

from __future__ import annotations

import re
from importlib import resources

import httpx

from ..http_server import serve_scripted

KEY = "page-key"
SCRIPT = resources.files("furnace_trio.server").joinpath("webui", "chat.js").read_text()


def check_headers(response: httpx.Response, content_type: str) -> None:
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    policy = [p.strip() for p in response.headers["content-security-policy"].split(";")]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    # nothing loosens the default: no inline script or style, no other origin
    assert not [p for p in policy if "unsafe" in p or "*" in p or "http" in p]
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_the_page_and_its_files() -> None:
    async with (
        serve_scripted(api_key=KEY) as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        page = await http.get("/")  # no key: the page asks for it when the API says 401
        check_headers(page, "text/html; charset=utf-8")
        html = page.text
        assert '<script src="/static/chat.js" defer></script>' in html
        assert re.findall(r"<script[^>]*>", html) == ['<script src="/static/chat.js" defer>']
        assert not re.search(r"\son[a-z]+=", html)  # no inline handlers (the CSP would block them)
        assert not re.search(r"\sstyle=", html)
        sources = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sources and all(s.startswith("/static/") for s in sources), sources
        for name, content_type in (
            ("chat.js", "text/javascript; charset=utf-8"),
            ("chat.css", "text/css; charset=utf-8"),
            ("favicon.svg", "image/svg+xml"),
        ):
            asset = await http.get(f"/static/{name}")
            check_headers(asset, content_type)
            # no other site: the SVG namespace is a name, not a request
            text = asset.text.replace('xmlns="http://www.w3.org/2000/svg"', "")
            assert "http://" not in text and "https://" not in text, name
        assert (await http.get("/static/chat.js")).text == SCRIPT
        # the API behind the page still wants the key
        assert (await http.get("/v1/models")).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/models", headers=headers)).status_code == 200


async def test_only_the_page_files_are_served() -> None:
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        for path in (
            "/static/index.html.bak",
            "/static/..%2Fpage.py",
            "/static/../routes/page.py",
            "/static/",
            "/static/CHAT.JS",
        ):
            response = await http.get(path)
            assert response.status_code == 404, path
            assert response.json()["error"]["code"] == "not_found"
        response = await http.post("/", json={})
        assert response.status_code == 405
        head = await http.head("/")
        assert head.status_code == 200 and head.content == b""


def test_the_script_writes_text_only() -> None:
    """No HTML sink in the page's script: model output reaches the DOM as text."""
    code = re.sub(r"//[^\n]*", "", SCRIPT)  # comments may name what the code avoids
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "createContextualFragment",
        "DOMParser",
        "eval(",
        "new Function",
        "srcdoc",
    ):
        assert sink not in code, sink
    assert "appendData(" in code and "textContent" in code
