"""The Responses API in the OpenAPI document: in step with its validator, and matching
what the server sends (scripted engine, real socket)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from furnace_trio.server.errors import APIError
from furnace_trio.server.openapi import openapi_document
from furnace_trio.server.responses_request import parse_responses_request
from furnace_trio.server.responses_schemas import RESPONSES_FIELDS

from ..http_server import MODEL_NAME, serve_scripted
from .test_openapi import VOCAB, _boundary_values, _events, _fields_read, _validator


def _schemas() -> dict[str, Any]:
    return openapi_document()["components"]["schemas"]  # type: ignore[no-any-return]


def test_validator_reads_exactly_the_published_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    published = set(_schemas()["ResponseRequest"]["properties"])
    read = _fields_read(monkeypatch, parse_responses_request, {"input": "hi"})
    assert read == published == set(RESPONSES_FIELDS)


def test_other_fields_are_refused_by_both() -> None:
    schema = _schemas()["ResponseRequest"]
    for body in ({"input": "x", "reasoning": {}}, {"input": "x", "prompt": {"id": "p"}}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(body)
        with pytest.raises(APIError) as refused:
            parse_responses_request(json.dumps(body).encode(), vocab_size=VOCAB)
        assert refused.value.param == next(k for k in body if k != "input")


def test_scalar_ranges_agree_with_the_schema() -> None:
    for spec in RESPONSES_FIELDS.values():
        if spec.type == "structured":
            continue
        for value, valid in _boundary_values(spec):
            assert jsonschema.Draft202012Validator(spec.json_schema()).is_valid(value) == valid
            try:
                parse_responses_request(
                    json.dumps({"input": "x", spec.name: value}).encode(), vocab_size=VOCAB
                )
                accepted = True
            except APIError as exc:
                accepted = False
                assert exc.param == spec.name, (spec.name, value, exc)
            assert accepted == valid, (spec.name, value)


async def test_real_responses_match_their_schemas() -> None:
    document = openapi_document()
    schemas = document["components"]["schemas"]

    def check(name: str, body: Any) -> None:
        _validator(document, schemas[name]).validate(body)

    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        created = await http.post(
            "/v1/responses",
            json={
                "model": MODEL_NAME,
                "input": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                ],
                "metadata": {"k": "v"},
            },
        )
        assert created.status_code == 200, created.text
        check("Response", created.json())
        response_id = created.json()["id"]
        check("Response", (await http.get(f"/v1/responses/{response_id}")).json())
        check(
            "ResponseItemList", (await http.get(f"/v1/responses/{response_id}/input_items")).json()
        )
        check("ResponseDeleted", (await http.delete(f"/v1/responses/{response_id}")).json())
        missing = await http.get(f"/v1/responses/{response_id}")
        assert missing.status_code == 404
        check("Error", missing.json())
        refused = await http.post("/v1/responses", json={"input": "x", "background": True})
        assert refused.status_code == 400
        check("Error", refused.json())

        streamed = await http.post(
            "/v1/responses", json={"model": MODEL_NAME, "input": "hi", "stream": True}
        )
    assert streamed.status_code == 200, streamed.text
    sse = document["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    event_validator = _validator(document, sse["text/event-stream"]["schema"])
    events = _events(streamed.text)
    assert [json.loads(e["data"])["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        event_validator.validate(event)
        data = json.loads(event["data"])
        assert data["type"] == event["event"]
        check("ResponseStreamEvent", data)
    assert events[-1]["event"] == "response.completed"
    for wrong in ({"data": "{}", "event": "message"}, {"data": "{}"}):
        assert not event_validator.is_valid(wrong)
