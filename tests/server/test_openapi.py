"""The OpenAPI document: valid OpenAPI 3.1, served, and in step with the validator."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from furnace_trio.server.chat_request import parse_chat_request
from furnace_trio.server.completion_request import parse_completion_request
from furnace_trio.server.errors import APIError
from furnace_trio.server.openapi import openapi_document
from furnace_trio.server.protocol import FieldBody
from furnace_trio.server.schemas import CHAT_FIELDS, COMPLETION_FIELDS, FieldSpec

from ..http_server import MODEL_NAME, serve_scripted

VOCAB = 1000


def test_document_is_valid_openapi() -> None:
    validate(openapi_document())  # type: ignore[arg-type]


def test_every_endpoint_is_documented() -> None:
    paths = openapi_document()["paths"]
    assert set(paths) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/sessions/{session_id}",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/health",
        "/metrics",
        "/status",
        "/admin/reload",
        "/openapi.json",
        "/",
        "/docs",
        "/static/{name}",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
    assert set(paths["/v1/sessions/{session_id}"]) >= {"get", "delete"}
    chat_ok = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat_ok) == {"application/json", "text/event-stream"}


def _fields_read(monkeypatch: pytest.MonkeyPatch, parse: Any, body: dict[str, Any]) -> set[str]:
    seen: set[str] = set()
    raw = FieldBody.raw

    def spy(self: FieldBody, name: str) -> Any:
        seen.add(name)
        return raw(self, name)

    monkeypatch.setattr(FieldBody, "raw", spy)
    parse(json.dumps(body).encode(), vocab_size=VOCAB)
    return seen


@pytest.mark.parametrize(
    ("parse", "fields", "schema_name", "body"),
    [
        (
            parse_chat_request,
            CHAT_FIELDS,
            "ChatCompletionRequest",
            {"messages": [{"role": "user", "content": "hi"}]},
        ),
        (
            parse_completion_request,
            COMPLETION_FIELDS,
            "CompletionRequest",
            {"prompt": "x"},
        ),
    ],
)
def test_validator_reads_exactly_the_published_fields(
    monkeypatch: pytest.MonkeyPatch,
    parse: Any,
    fields: dict[str, FieldSpec],
    schema_name: str,
    body: dict[str, Any],
) -> None:
    """No drift: the fields the validator reads (derived by spying on it) are the fields the
    document publishes, and reading an undeclared one is an error."""
    published = set(openapi_document()["components"]["schemas"][schema_name]["properties"])
    assert _fields_read(monkeypatch, parse, body) == published == set(fields)
    with pytest.raises(KeyError):
        FieldBody({}, fields).raw("not_a_field")


def _boundary_values(spec: FieldSpec) -> list[tuple[Any, bool]]:
    """(value, valid by the schema) pairs around a scalar field's declared range."""
    if spec.type == "boolean":
        return [(True, True), (False, True), (1, False), ("true", False)]
    if spec.type == "string":
        low, high = int(spec.low or 0), int(spec.high or 10)
        return [("x" * max(low, 1), True), ("x" * (high + 1), spec.high is None), (5, False)]
    values: list[tuple[Any, bool]] = [("1", False), (True, False)]
    if spec.low is not None:
        values.append((spec.low, not spec.low_open))
        values.append((spec.low - 1, False))
    if spec.high is not None:
        values.append((spec.high, True))
        values.append((spec.high + 1, False))
    if spec.type == "integer":
        values.append((1.5, False))
    return values


@pytest.mark.parametrize(
    ("parse", "fields", "base"),
    [
        (
            parse_chat_request,
            CHAT_FIELDS,
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
        ),
        # echo: max_tokens 0 is for it alone (a rule across fields, as top_logprobs's)
        (parse_completion_request, COMPLETION_FIELDS, {"prompt": "x", "echo": True}),
    ],
)
def test_scalar_ranges_agree_with_the_schema(
    parse: Any, fields: dict[str, FieldSpec], base: dict[str, Any]
) -> None:
    """Each scalar field's boundary values: the schema and the validator agree."""
    for spec in fields.values():
        if spec.type == "structured" or spec.name in base:
            continue
        schema = spec.json_schema()
        for value, valid in _boundary_values(spec):
            assert jsonschema.Draft202012Validator(schema).is_valid(value) == valid, (spec, value)
            body = {**base, spec.name: value}
            if spec.name == "best_of" and valid:
                body["n"] = value if value <= 16 else 1
                if value > 16:
                    continue
            try:
                parse(json.dumps(body).encode(), vocab_size=VOCAB)
                accepted = True
            except APIError as exc:
                accepted = False
                assert exc.param == spec.name, (spec.name, value, exc)
            assert accepted == valid, (spec.name, value)


@pytest.mark.parametrize(
    ("path", "schema_name", "body"),
    [
        (
            "/v1/chat/completions",
            "ChatCompletion",
            {"messages": [{"role": "user", "content": "a"}]},
        ),
        ("/v1/completions", "TextCompletion", {"prompt": "hello", "logprobs": 2}),
        ("/v1/models", "ModelList", None),
        (f"/v1/models/{MODEL_NAME}", "Model", None),
        ("/health", "Health", None),
        ("/status", "Status", None),
        ("/tokenize", "TokenizeResponse", {"prompt": "hi there", "return_token_strs": True}),
        ("/tokenize", "TokenizeResponse", {"messages": [{"role": "user", "content": "a"}]}),
        ("/detokenize", "DetokenizeResponse", {"tokens": [1, 2, 3]}),
        ("/tokenizer_info", "TokenizerInfo", None),
        ("/tokenize", "Error", {"prompt": "a", "messages": []}),
        ("/v1/models/nope", "Error", None),
        ("/v1/sessions/nope", "Error", None),
        ("/v1/chat/completions", "Error", {"messages": []}),
    ],
)
async def test_real_responses_match_their_schemas(
    path: str, schema_name: str, body: dict[str, Any] | None
) -> None:
    document = openapi_document()
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        served_doc = (await http.get("/openapi.json")).json()
        assert served_doc == document
        if body is None:
            response = await http.get(path)
        else:
            response = await http.post(path, json=body)
    _validator(document, document["components"]["schemas"][schema_name]).validate(response.json())


def _validator(document: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Validator:
    """``schema`` checked with the document's components in reach of its ``$ref``s."""
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def _events(text: str) -> list[dict[str, str]]:
    """Server-sent events as the HTML standard parses them (what schemathesis checks):
    blank-line separated, ``data`` lines joined by newlines, ``event`` "message" if absent,
    comments and events without data skipped."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, list[str]] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))
        if "data" in fields:
            event = {name: values[-1] for name, values in fields.items()}
            event["data"] = "\n".join(fields["data"])
            event.setdefault("event", "message")
            events.append(event)
    return events


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}],
                "logprobs": True,
                "top_logprobs": 2,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/v1/completions",
            {"prompt": "hello", "logprobs": 2, "stream_options": {"include_usage": True}},
        ),
    ],
)
async def test_streamed_events_match_their_schemas(path: str, body: dict[str, Any]) -> None:
    """Each event of a real stream matches the documented event schema, and its data (JSON
    until ``[DONE]``, which comes last) matches the chunk schema the event schema names."""
    document = openapi_document()
    sse = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    event_schema = sse["schema"]
    json_data = event_schema["properties"]["data"]["anyOf"][1]["contentSchema"]
    chunk_schema = json_data["oneOf"][0]
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        response = await http.post(path, json={"model": MODEL_NAME, "stream": True, **body})
    assert response.status_code == 200, response.text
    events = _events(response.text)
    assert len(events) >= 3
    assert events[-1]["data"] == "[DONE]"
    event_validator = _validator(document, event_schema)
    chunk_validator = _validator(document, chunk_schema)
    for event in events:
        event_validator.validate(event)
    for event in events[:-1]:
        chunk_validator.validate(json.loads(event["data"]))
    # and a wrong event is caught: the schema is not vacuous
    for wrong in ({"data": "x", "event": "error"}, {"data": "x", "id": "1"}, {"event": "message"}):
        assert not event_validator.is_valid(wrong)
