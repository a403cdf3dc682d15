"""A client's JSON Schema (a tool's ``parameters``, ``response_format``'s schema), checked
before anything compiles it: a size budget, a known draft, the draft's meta-schema, and
its regular expressions as Python reads them.

- **Size budget.** All the schemas of one request hold at most ``FURNACE_MAX_SCHEMA_NODES``
  JSON values together (default :data:`DEFAULT_MAX_SCHEMA_NODES`). Every later cost grows
  with it: the meta-schema check, the grammar llguidance compiles (about 0.3 s for 15,000
  values, 2 cores), the prompt the tools are rendered into, each tool call's argument
  check. Counting stops at the budget, so an oversized schema costs no more than a fitting
  one.
- **Meta-schema with jsonschema-rs.** ``jsonschema``'s ``check_schema`` walks draft
  2020-12's dynamic references in Python, 0.15 to 0.7 ms per subschema: 60 s for a schema
  of 44,000 ``anyOf`` branches. jsonschema-rs checks the same meta-schemas at about 0.25 us
  per value (50 ms for those 44,000 branches; about 3 ms at the default budget).
- **Known drafts only.** jsonschema-rs fetches an unknown ``$schema`` URI over the network
  to read it as a meta-schema; only drafts 4, 6, 7, 2019-09 and 2020-12 (which it bundles)
  are accepted, so a client cannot make the server send requests.
- **Regexes as Python reads them.** Tool-call arguments are later checked with
  ``jsonschema``, which compiles each ``pattern`` with :mod:`re`; a pattern ``re`` cannot
  compile is a 400 here (as ``check_schema``'s ``regex`` format made it), not an error
  while a response streams.

Plain functions over decoded JSON, run in the worker thread that parses the body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from furnace_trio.server.config import DEFAULT_MAX_SCHEMA_NODES
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import kind_of

__all__ = ["DEFAULT_MAX_SCHEMA_NODES", "SchemaBudget", "check_schema"]

_KNOWN_DRAFT = re.compile(
    r"^https?://json-schema\.org/(draft-0[467]/schema|draft/(2019-09|2020-12)/schema)#?$"
)
#: Keys whose values are JSON data, not schemas: a ``pattern`` key inside them is data.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


@dataclass(slots=True)
class SchemaBudget:
    """What is left of one request's budget of schema values."""

    limit: int
    used: int = 0

    def spend(self, schema: object, where: str) -> None:
        """Count ``schema``'s values against the budget; a 400 naming ``where`` past it."""
        left = self.limit - self.used
        count = 0
        pending = [schema]
        while pending:
            item = pending.pop()
            count += 1
            if count > left:
                raise invalid_request(
                    f"{where} takes the JSON schemas of this request past {self.limit} values "
                    "(FURNACE_MAX_SCHEMA_NODES); send a smaller schema",
                    where,
                )
            if isinstance(item, dict):
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        self.used += count


def check_schema(schema: object, where: str, budget: SchemaBudget) -> Mapping[str, Any]:
    """``schema`` if it is a valid JSON Schema within the budget, else a 400 naming ``where``."""
    if not isinstance(schema, dict):
        raise invalid_request(f"{where} must be a JSON schema object, not {kind_of(schema)}", where)
    budget.spend(schema, where)
    draft = schema.get("$schema")
    if draft is not None and not (isinstance(draft, str) and _KNOWN_DRAFT.match(draft)):
        raise invalid_request(
            f"{where}.$schema must name JSON Schema draft 4, 6, 7, 2019-09 or 2020-12 "
            f"(e.g. https://json-schema.org/draft/2020-12/schema), got {str(draft)[:100]!r}",
            f"{where}.$schema",
        )
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        at = "/".join(str(part) for part in exc.instance_path)
        raise invalid_request(
            f"{where} is not a valid JSON schema: {exc.message} (at {at or 'its root'})", where
        ) from None
    except jsonschema_rs.ReferencingError as exc:  # not expected with a bundled draft
        raise invalid_request(f"{where} is not a valid JSON schema: {exc}", where) from None
    _check_patterns(schema, where)
    return schema


def _check_patterns(schema: dict[str, Any], where: str) -> None:
    """Every ``pattern`` and ``patternProperties`` key compiles with :mod:`re`."""
    pending: list[object] = [schema]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        patterns: list[object] = []
        if isinstance(item.get("pattern"), str):
            patterns.append(item["pattern"])
        if isinstance(item.get("patternProperties"), dict):
            patterns.extend(item["patternProperties"].keys())
        for pattern in patterns:
            try:
                re.compile(str(pattern))
            except (re.error, RecursionError, OverflowError) as exc:
                raise invalid_request(
                    f"{where} holds a pattern that is not a valid regular expression "
                    f"({str(pattern)[:100]!r}: {exc})",
                    where,
                ) from None
        pending.extend(value for key, value in item.items() if key not in _DATA_KEYS)
