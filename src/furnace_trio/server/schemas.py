"""Request fields, declared once: the validator (``protocol.py``) and the OpenAPI document
(``openapi.py``) both read these tables, so what the server checks and what it publishes
cannot drift apart.

Each :class:`FieldSpec` names one top-level body field with its type, range, default and
description. Scalar fields (integer, number, boolean, string) are validated generically from
the declaration. Structured fields (messages, tools, stop, ...) carry the JSON Schema they are
published with; their parsers in ``protocol.py`` are stricter in places a schema cannot say
(a token id inside the vocabulary, a ``tool_choice`` naming one of the tools), never looser:
``tests/test_openapi.py`` and the schemathesis fuzz run (negative data must be rejected)
hold them to it.

Caps on hostile input live here too, with why each exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

MAX_N = 16
#: Most prompts in one ``/v1/completions`` request (each is its own engine request).
MAX_PROMPTS = 128
MAX_STOP_SEQUENCES = 16
#: Longest stop string, in characters: the stop matcher holds back up to this much text.
MAX_STOP_LENGTH = 512
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: Most ``logit_bias`` entries (OpenAI's limit): each is a logits write on every step.
MAX_LOGIT_BIAS = 300
#: Most chat messages per request: templates loop over them in Python.
MAX_MESSAGES = 2048
#: Deepest JSON nesting accepted anywhere in a body (tool schemas included): deeper
#: structures would overflow the recursion of the JSON Schema checker and of templates.
MAX_JSON_DEPTH = 64
#: Most JSON values (keys included, as bounded from the body's commas, colons and brackets)
#: in one body. Decoding is C code that holds the GIL: at this cap it takes 10 to 70 ms on
#: a 2-core machine (a list of token ids at the low end, one object of 32,000 keys at the
#: high end); a 3.9 MiB schema of 44,000 subschemas took 200 ms and 8 MiB of ``[],`` 2 s.
MAX_JSON_VALUES = 65_536
#: A prompt of more than ``max_context * MAX_CHARS_PER_TOKEN`` characters cannot fit the
#: context with any real tokenizer; it is refused before the template or tokenizer runs.
MAX_CHARS_PER_TOKEN = 32
MAX_SESSION_ID_LENGTH = 256
SEED_LIMIT = 2**63
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

FieldType = Literal["integer", "number", "boolean", "string", "structured"]


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One request body field.

    ``low``/``high`` bound numbers (``low_open``: ``low`` itself is excluded) and, for
    strings, the length. ``schema`` is required for ``structured`` fields and is their
    published JSON Schema (``null`` is always accepted too, except for ``required`` fields).
    """

    name: str
    type: FieldType
    description: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    required: bool = False
    schema: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.type == "structured") != (self.schema is not None):
            raise ValueError(f"{self.name}: a schema is given exactly for structured fields")

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema (2020-12, as OpenAPI 3.1 uses) of this field's value."""
        if self.schema is not None:
            out = dict(self.schema)
            if not self.required:
                out = {"anyOf": [out, {"type": "null"}]}
        else:
            out = {"type": self.type if self.required else [self.type, "null"]}
            if self.type == "string":
                if self.low is not None:
                    out["minLength"] = int(self.low)
                if self.high is not None:
                    out["maxLength"] = int(self.high)
            else:
                if self.low is not None:
                    out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
                if self.high is not None:
                    out["maximum"] = self.high
        out["description"] = self.description
        if self.default is not None:
            out["default"] = self.default
        return out


#: How the samplers' knobs default (see furnace_trio.loading.generation_defaults).
_MODEL_DEFAULT = "Unset: the model's own default where it ships one (GET /v1/models)"


def _table(*specs: FieldSpec) -> Mapping[str, FieldSpec]:
    return MappingProxyType({spec.name: spec for spec in specs})


_TEXT_PART: Mapping[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_TOOL_CALL: Mapping[str, Any] = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": ["string", "null"]},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "arguments": {"type": "string"},
            },
        },
    },
}
_MESSAGE: Mapping[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _TEXT_PART},
                {"type": "null"},
            ],
            "description": "Required unless an assistant message carries tool_calls.",
        },
        "name": {"type": ["string", "null"]},
        "tool_call_id": {
            "type": ["string", "null"],
            "description": "Required on a tool message.",
        },
        "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
    },
}
_TOOL: Mapping[str, Any] = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": ["string", "null"]},
                "parameters": {"type": ["object", "null"], "description": "A JSON Schema."},
            },
        },
    },
}

COMMON_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("model", "string", "The model to use; omitted means the one this server serves."),
    FieldSpec("stream", "boolean", "Stream the answer as server-sent events.", False),
    FieldSpec(
        "stream_options",
        "structured",
        "Streaming options; include_usage adds a last chunk with the usage.",
        schema={
            "type": "object",
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
        },
    ),
    FieldSpec(
        "max_tokens",
        "integer",
        "Most tokens to generate; prompt + max_tokens must fit the context, and at most "
        "the server's FURNACE_MAX_OUTPUT_TOKENS. Unset: that setting, else the rest of the "
        "context.",
        low=1,
    ),
    FieldSpec(
        "temperature",
        "number",
        f"Sampling temperature; 0 is greedy. {_MODEL_DEFAULT}, else 1.",
        None,
        0.0,
        2.0,
    ),
    FieldSpec(
        "top_p",
        "number",
        f"Nucleus sampling mass. {_MODEL_DEFAULT}, else 1.",
        None,
        0.0,
        1.0,
        low_open=True,
    ),
    FieldSpec(
        "top_k",
        "integer",
        f"Sample among the k likeliest tokens; -1 or 0: all. {_MODEL_DEFAULT}, else all.",
        low=-1,
    ),
    FieldSpec(
        "min_p",
        "number",
        f"Drop tokens below min_p times the top probability. {_MODEL_DEFAULT}, else 0.",
        None,
        0,
        1,
    ),
    FieldSpec("presence_penalty", "number", "Penalty for tokens already present.", 0.0, -2, 2),
    FieldSpec("frequency_penalty", "number", "Penalty per earlier occurrence.", 0.0, -2, 2),
    FieldSpec(
        "repetition_penalty",
        "number",
        f"Multiplicative penalty on repeated tokens (1: none). {_MODEL_DEFAULT}, else 1.",
        None,
        0.0,
        2.0,
        low_open=True,
    ),
    FieldSpec(
        "logit_bias",
        "structured",
        f"Token id (as a string) -> bias added to its logit; at most {MAX_LOGIT_BIAS} entries.",
        schema={
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    ),
    FieldSpec(
        "seed",
        "integer",
        "Seed for reproducible sampling.",
        low=-SEED_LIMIT,
        high=SEED_LIMIT - 1,
    ),
    FieldSpec("n", "integer", "How many choices to generate.", 1, 1, MAX_N),
    FieldSpec(
        "stop",
        "structured",
        f"Up to {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_LENGTH} characters that "
        "end generation (not included in the output).",
        schema={
            "anyOf": [
                {"type": "string", "maxLength": MAX_STOP_LENGTH},
                {
                    "type": "array",
                    "maxItems": MAX_STOP_SEQUENCES,
                    "items": {"type": "string", "maxLength": MAX_STOP_LENGTH},
                },
            ]
        },
    ),
    FieldSpec("ignore_eos", "boolean", "Keep generating past the end-of-text token.", False),
)

CHAT_FIELDS: Mapping[str, FieldSpec] = _table(
    FieldSpec(
        "messages",
        "structured",
        f"The conversation, 1 to {MAX_MESSAGES} messages.",
        required=True,
        schema={"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _MESSAGE},
    ),
    *COMMON_FIELDS,
    FieldSpec("max_completion_tokens", "integer", "Same as max_tokens (and wins over it).", low=1),
    FieldSpec("logprobs", "boolean", "Return the log probability of each token.", False),
    FieldSpec(
        "top_logprobs",
        "integer",
        "Alternatives per token with their log probabilities (needs logprobs).",
        0,
        0,
        MAX_CHAT_TOP_LOGPROBS,
    ),
    FieldSpec(
        "tools",
        "structured",
        "Functions the model may call.",
        schema={"type": "array", "items": _TOOL},
    ),
    FieldSpec(
        "tool_choice",
        "structured",
        "none, auto, required, or one named function (which must be among the tools).",
        schema={
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            ]
        },
    ),
    FieldSpec("parallel_tool_calls", "boolean", "Allow several calls in one answer.", True),
    FieldSpec(
        "response_format",
        "structured",
        "Constrain the answer to JSON (json_object) or to a JSON Schema (json_schema).",
        schema={
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "description": "Required when type is json_schema.",
                    "properties": {
                        "name": {"type": ["string", "null"]},
                        "schema": {"type": ["object", "null"]},
                    },
                },
            },
        },
    ),
    FieldSpec(
        "session_id",
        "string",
        "Continue a server-side session (same as the X-Session-Id header).",
        low=1,
        high=MAX_SESSION_ID_LENGTH,
    ),
)

COMPLETION_FIELDS: Mapping[str, FieldSpec] = _table(
    FieldSpec(
        "prompt",
        "structured",
        "The prompt, or a batch of prompts: a string, a list of strings, token ids, or a "
        f"list of lists of token ids (at most {MAX_PROMPTS} prompts). Choice i * n + j is "
        "sample j of prompt i.",
        required=True,
        schema={
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                    "items": {"type": "string"},
                },
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "integer", "minimum": 0},
                    },
                },
            ]
        },
    ),
    *(spec for spec in COMMON_FIELDS if spec.name != "max_tokens"),  # its own below
    FieldSpec(
        "logprobs",
        "integer",
        "Return this many alternatives per token with log probabilities.",
        low=0,
        high=MAX_COMPLETION_LOGPROBS,
    ),
    FieldSpec(
        "max_tokens",
        "integer",
        "Most tokens to generate; prompt + max_tokens must fit the context, and at most "
        "the server's FURNACE_MAX_OUTPUT_TOKENS. Unset: that setting, else 16. 0 (with echo "
        "only): the prompt alone, scored when logprobs is given.",
        low=0,
    ),
    FieldSpec(
        "echo",
        "boolean",
        "Return each prompt before its completion; with logprobs, the prompt's tokens are "
        "scored too (the first one's logprob is null).",
        False,
    ),
    FieldSpec("best_of", "integer", "Not supported beyond n: must equal n.", low=1),
    FieldSpec("suffix", "structured", "Not supported: only empty.", schema={"const": ""}),
)

_MODEL_FIELD = COMMON_FIELDS[0]

#: ``POST /tokenize`` (as vLLM's): a prompt, or messages rendered by the chat template.
TOKENIZE_FIELDS: Mapping[str, FieldSpec] = _table(
    _MODEL_FIELD,
    FieldSpec("prompt", "string", "Text to tokenize (or give messages)."),
    FieldSpec(
        "messages",
        "structured",
        "A conversation to render with the chat template, then tokenize (or give prompt).",
        schema=CHAT_FIELDS["messages"].schema,
    ),
    FieldSpec(
        "add_special_tokens",
        "boolean",
        "Add the model's special tokens (BOS): default true for a prompt, false for messages "
        "(the template writes them).",
    ),
    FieldSpec(
        "add_generation_prompt",
        "boolean",
        "With messages: end with the assistant turn's opening.",
        True,
    ),
    FieldSpec("return_token_strs", "boolean", "Also return each token's text.", False),
)

#: ``POST /detokenize`` (as vLLM's).
DETOKENIZE_FIELDS: Mapping[str, FieldSpec] = _table(
    _MODEL_FIELD,
    FieldSpec(
        "tokens",
        "structured",
        "Token ids to turn into text.",
        required=True,
        schema={"type": "array", "items": {"type": "integer", "minimum": 0}},
    ),
)
