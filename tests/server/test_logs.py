"""The server's logs: one timestamped line per request with the tokens it streamed, one
"Running on" line, no access lines, and JSON lines with ``FURNACE_LOG_FORMAT=json``.

The line of a stream the client left is read in this process (caplog); the whole output
from a server process of its own, as a user runs it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import httpx
import pytest

from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.log_setup import FIELDS, JsonFormatter, TextFormatter

from ..real_model import serve_real
from ..served_process import HYPERCORN, SERVE, serve_process
from .waiting import wait_until

STORY = {
    "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
    "temperature": 0,
    "max_tokens": 1000,
    "stream": True,
}
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


def request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "furnace_trio.server.request_log"]


async def test_an_aborted_stream_logs_the_tokens_it_streamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Usage counts come with a sample's end, which a stream the client left never has:
    the line counts the tokens of the deltas streamed instead (it said 0)."""
    caplog.set_level(logging.INFO, logger="furnace_trio.server.request_log")
    async with serve_real() as (url, _engine), httpx.AsyncClient(base_url=url) as http:
        received = 0
        async with http.stream("POST", "/v1/chat/completions", json=STORY) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        received += 1
                if received >= 40:
                    break
        await wait_until(lambda: request_lines(caplog), "the request's log line")
    [record] = request_lines(caplog)
    fields = getattr(record, FIELDS)
    assert fields["status"] == 499 and fields["finish"] == "-"
    # each content chunk carried at least one token; some may have been generated since
    assert 40 <= fields["generated_tokens"] < 1000
    assert f"generated_tokens={fields['generated_tokens']} " in record.getMessage()


def test_json_lines_carry_the_fields_and_the_traceback() -> None:
    record = logging.LogRecord(
        "furnace_trio.server.request_log", logging.INFO, __file__, 1, "request %s", ("r1",), None
    )
    setattr(record, FIELDS, {"request_id": "r1", "generated_tokens": 7, "message": "clash"})
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request r1"  # a field never hides the message
    assert line["level"] == "INFO" and line["logger"] == "furnace_trio.server.request_log"
    assert line["generated_tokens"] == 7 and line["request_id"] == "r1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter().format(failed)
    assert "\n" not in text  # one line, the traceback escaped inside it
    assert "ValueError: boom" in json.loads(text)["exception"]
    assert TIMESTAMP.match(TextFormatter().format(record) + " ")


def test_log_format_is_checked() -> None:
    assert ServerConfig.from_env({"FURNACE_LOG_FORMAT": "JSON"}).log_format == "json"
    with pytest.raises(ConfigError, match="FURNACE_LOG_FORMAT"):
        ServerConfig.from_env({"FURNACE_LOG_FORMAT": "xml"})


def _chat(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_hypercorn_logs_one_running_on_line_and_no_access_lines(tmp_path: Path) -> None:
    """``hypercorn -c hypercorn.toml``: every line timestamped, "Running on" once, nothing
    on stdout (hypercorn's access lines), and the request's own line."""
    with serve_process(HYPERCORN, tmp_path) as served:
        _chat(served.url)
        served.wait_for_log("request chatcmpl-")
    lines = served.logs().splitlines()
    assert served.stdout.read_text() == ""
    assert all(TIMESTAMP.match(line) for line in lines if not line.startswith((" ", "Trace")))
    assert sum("Running on" in line for line in lines) == 1
    assert not [line for line in lines if " - - " in line]
    [request] = [line for line in lines if "request chatcmpl-" in line]
    assert re.search(r"status=200 prompt_tokens=\d+ cached_tokens=0 generated_tokens=5 ", request)


def test_json_log_format_writes_only_json_lines(tmp_path: Path) -> None:
    """``python -m furnace_trio.server.serve`` with ``FURNACE_LOG_FORMAT=json``."""
    with serve_process(SERVE, tmp_path, {"FURNACE_LOG_FORMAT": "json"}) as served:
        _chat(served.url)
        served.wait_for_log("request chatcmpl-")
    lines = [json.loads(line) for line in served.logs().splitlines()]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    assert sum("Running on" in line["message"] for line in lines) == 1
    [request] = [line for line in lines if line["logger"] == "furnace_trio.server.request_log"]
    assert request["status"] == 200 and request["generated_tokens"] == 5
    assert request["message"].startswith(f"request {request['request_id']} status=200")
