"""Server configuration from ``FURNACE_*`` environment variables.

Every value is parsed and checked once, at startup: a typo in a deployment should stop the
server with a message naming the variable, not surface later as a confusing request error.
Parsing does no I/O (the model path is not opened here; the backend factory does that).
The same settings may come from a TOML file named by ``FURNACE_CONFIG``, read and merged
with the environment by :mod:`furnace_trio.server.config_file`, and read again on a reload
(:mod:`furnace_trio.server.reload`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from furnace_trio.runtime.native.config import DEFAULT_NATIVE_CONFIG, NativeConfig
from furnace_trio.server.api_keys import APIKey
from furnace_trio.server.config_env import check_values, environment_values
from furnace_trio.server.config_values import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_SCHEMA_NODES,
    ConfigError,
    Device,
)
from furnace_trio.server.setting import Setting, setting, settings

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_SCHEMA_NODES",
    "ConfigError",
    "ServerConfig",
]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the HTTP server and the backend factory need to know.

    Each field's metadata names its ``FURNACE_*`` variable and says what it does
    (:mod:`furnace_trio.server.setting`): ``docs/configuration.md`` is rendered from it.
    ``None`` where the backend chooses by device (:mod:`furnace_trio.server.backend`).
    """

    model: str | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MODEL",
            "A `.gguf` file or a Hugging Face model directory (`config.json`, `*.safetensors`, "
            "`tokenizer.json`); see [models and formats](models.md).",
            shown="the embedded SmolLM2-135M-Instruct",
        ),
    )
    model_name: str | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MODEL_NAME",
            "The name clients pass as `model` (and `/v1/models` lists).",
            shown="derived from the model",
        ),
    )
    device: Device = field(
        default="auto",
        metadata=setting(
            "FURNACE_DEVICE", "`cpu`, `cuda`, or `auto` (CUDA when torch sees a GPU)."
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=setting(
            "FURNACE_DTYPE",
            "`float32`, `bfloat16` or `float16`; `auto`: float32 on the CPU, bfloat16 on a GPU.",
        ),
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata=setting(
            "FURNACE_API_KEY",
            "When set, requests to `/v1/...` and the tokenizer paths need "
            "`Authorization: Bearer <key>` (401 otherwise); unset (and no `[[api_keys]]`), no "
            "authentication. Beside the config file's named keys it is named `default`.",
        ),
    )
    admin_key: str | None = field(
        default=None,
        repr=False,
        metadata=setting(
            "FURNACE_ADMIN_KEY",
            "When set, `GET /status` and `POST /admin/reload` need this key (and the API keys "
            "do not open them); unset, they take the API keys.",
        ),
    )
    max_running: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MAX_RUNNING",
            "Sequences decoding at once (fewer when the KV cache cannot hold every admitted "
            "request's prompt + `max_tokens`).",
            shown="32 on the CPU, 128 on a GPU",
        ),
    )
    max_waiting: int = field(
        default=256,
        metadata=setting(
            "FURNACE_MAX_WAITING",
            "Queued sequences (a request of `n` samples counts `n`, a completions batch every "
            "prompt times `n`) before new requests get 503 with `Retry-After`; a batch the queue "
            "cannot take whole is refused whole.",
        ),
    )
    max_sequences_per_request: int = field(
        default=128,
        metadata=setting(
            "FURNACE_MAX_SEQUENCES_PER_REQUEST",
            "Most sequences (prompts x `n`) one request may ask for, capped by "
            "`FURNACE_MAX_WAITING`; more is a 400 naming `n` (or `prompt`).",
        ),
    )
    max_schema_nodes: int = field(
        default=DEFAULT_MAX_SCHEMA_NODES,
        metadata=setting(
            "FURNACE_MAX_SCHEMA_NODES",
            "JSON values that all the client's schemas of one request (tools' `parameters`, "
            "`response_format`) may hold together; more is a 400 naming the schema "
            "(see [reliability](reliability.md)).",
        ),
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MAX_STEP_TOKENS",
            "Tokens per model step (decodes plus prefill chunks).",
            shown="512 on the CPU, 4096 on a GPU",
        ),
    )
    kv_cache_mb: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_KV_CACHE_MB",
            "The KV cache's size in MiB.",
            shown="1024 on the CPU, half the free GPU memory on a GPU",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=setting(
            "FURNACE_KV_CACHE_DTYPE",
            "`auto`: float16 with `FURNACE_QUANT` `auto`, `q4` or `int8` on the CPU, else the "
            "model's dtype; `model`: the model's dtype; `float16`; `int8`: a byte per value and a "
            "float32 scale per token and KV head, 1.9 times the tokens of float16 in the same "
            "memory ([models and formats](models.md#kv-cache)).",
        ),
    )
    max_context: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MAX_CONTEXT",
            "A cap on prompt plus completion tokens.",
            shown="the model's context length",
        ),
    )
    max_output_tokens: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_MAX_OUTPUT_TOKENS",
            "The `max_tokens` of a request that names none, and a cap: a request asking for more "
            "gets a 400 naming the limit. Unset: no cap; a chat request without `max_tokens` may "
            "fill the rest of the context, a completions request gets 16 tokens "
            "([output length](api-guide.md#output-length-and-sampling-defaults)).",
        ),
    )
    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES,
        metadata=setting(
            "FURNACE_MAX_BODY_BYTES",
            "Request bodies larger than this many bytes get 413.",
            shown="4194304 (4 MiB)",
        ),
    )
    max_response_bytes: int = field(
        default=DEFAULT_MAX_RESPONSE_BYTES,
        metadata=setting(
            "FURNACE_MAX_RESPONSE_BYTES",
            "What one request may hold generated but unsent (estimated response bytes; about 470 "
            "tokens with 20 `top_logprobs`, 4,000 without); past it the request pauses, keeping "
            "its KV, until its client reads again ([reliability](reliability.md)).",
            shown="1048576 (1 MiB)",
        ),
    )
    log_level: str = field(
        default="INFO",
        metadata=setting("FURNACE_LOG_LEVEL", "`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`."),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "FURNACE_LOG_FORMAT",
            "`text`: lines for a person on stderr; `json`: one JSON object a line "
            "([operations](operations.md#logs)).",
        ),
    )
    tool_parser: str = field(
        default="auto",
        metadata=setting(
            "FURNACE_TOOL_PARSER",
            "The tool-call output format: `hermes`, `llama3`, `mistral`, or `auto` (from the chat "
            "template; see [tools](tools.md)).",
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=setting(
            "FURNACE_QUANT",
            "Weight quantization on the CPU: `auto` keeps a GGUF's Q4_0, Q4_1, Q5_0, Q8_0 and "
            "Q4_K-Q6_K weights as they are and makes others int8; `q4`, `int8`, `none` (float) "
            "([models and formats](models.md#quantization)).",
        ),
    )
    session_ttl_s: float = field(
        default=1800.0,
        metadata=setting("FURNACE_SESSION_TTL_S", "Idle sessions expire after this many seconds."),
    )
    session_max_blocks: int | None = field(
        default=None,
        metadata=setting(
            "FURNACE_SESSION_MAX_BLOCKS",
            "KV blocks all sessions may pin; beyond it the least recently used lose their KV "
            "(not their history).",
            shown="half the KV pool",
        ),
    )
    max_sessions: int = field(
        default=1024,
        metadata=setting(
            "FURNACE_MAX_SESSIONS",
            "Sessions kept; beyond it the least recently used idle one is dropped.",
        ),
    )
    session_store: str | None = field(
        default=None,
        metadata=setting(
            "FURNACE_SESSION_STORE",
            "`redis://...` (or `rediss://`, `unix://`): sessions, turn locks and stored "
            "responses shared by replicas behind a load balancer; unset, they live in this "
            "process ([a replica cluster](deploy.md)).",
        ),
    )
    prefix_cache: bool = field(
        default=True,
        metadata=setting(
            "FURNACE_PREFIX_CACHE",
            "Reuse the KV of cached prompt prefixes (full 16-token blocks, exact match).",
        ),
    )
    step_timeout_s: float = field(
        default=120.0,
        metadata=setting(
            "FURNACE_STEP_TIMEOUT_S",
            "Watchdog: a model step running longer marks the engine failed (503s from then on; "
            "see [reliability](reliability.md)).",
        ),
    )
    stream_interval: int = field(
        default=1,
        metadata=setting(
            "FURNACE_STREAM_INTERVAL",
            "A streamed sample's tokens after its first are sent in groups of this many (as "
            "vLLM's `--stream-interval`): fewer, larger chunks and less CPU per token; stop "
            "strings are then seen up to this many tokens late (computed, not sent).",
        ),
    )
    target_itl_ms: float | None = field(
        default=None,
        metadata=setting(
            "FURNACE_TARGET_ITL_MS",
            "Pace prefill by measured time: while streams decode, a long prompt's chunks are "
            "sized so that a step takes about this many milliseconds, from step costs learned "
            "online (`/status` `engine.pacing`, `furnace_pacing_*` gauges); a prompt with no "
            "decodes running gets the whole `FURNACE_MAX_STEP_TOKENS`, which stays the cap. "
            "Unset or `0`: the token budget alone decides. Trades long prompts' time to first "
            "token for the running streams' inter-token latency "
            "([operations](operations.md#prefill-pacing)).",
        ),
    )
    speculative: str = field(
        default="off",
        metadata=setting(
            "FURNACE_SPECULATIVE",
            "Speculative decoding: `ngram` drafts next tokens from the prompt and output so far "
            "(prompt lookup) and verifies them in one step; `draft:<path>` drafts them with a "
            "smaller model of the same tokenizer (a GGUF file or Hugging Face directory, as "
            "`FURNACE_MODEL`); `mtp` with the model's own multi-token-prediction layer (MiMo "
            "checkpoints); greedy output is unchanged token for token, sampling keeps its "
            "distribution; `off` ([speculative decoding](speculative.md)).",
        ),
    )
    speculative_tokens: int = field(
        default=16,
        metadata=setting(
            "FURNACE_SPECULATIVE_TOKENS",
            "Most draft tokens per step, whichever sequences draft them.",
        ),
    )
    speculative_max_batch: int = field(
        default=4,
        metadata=setting(
            "FURNACE_SPECULATIVE_MAX_BATCH",
            "No sequence drafts while more than this many decode.",
        ),
    )
    cuda_graphs: bool = field(
        default=True,
        metadata=setting(
            "FURNACE_CUDA_GRAPHS",
            "On a GPU, replay each all-decode step from a CUDA graph captured at startup "
            "(`furnace_trio.runtime.cuda_graphs`) instead of launching its kernels one by one; "
            "a capture that fails is logged and turns them off.",
        ),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "FURNACE_DRAIN_TIMEOUT_S",
            "On shutdown, how long requests in flight may run before they are cancelled (with an "
            "error event or object); see [operations](operations.md#drain).",
        ),
    )
    exit_on_engine_failure: bool = field(
        default=False,
        metadata=setting(
            "FURNACE_EXIT_ON_ENGINE_FAILURE",
            "When the engine dies or the watchdog fires, exit with status 3 so that a supervisor "
            "restarts the server.",
        ),
    )
    native: bool = field(
        default=True,
        metadata=setting(
            "FURNACE_NATIVE",
            "The native CPU kernels; `false` serves with torch's and fbgemm's kernels only (much "
            "slower).",
        ),
    )
    native_build: NativeConfig = field(
        default=DEFAULT_NATIVE_CONFIG,
        metadata=settings(
            Setting(
                "FURNACE_NATIVE_FLAGS",
                "Extra compiler flags (shell words) for the native kernels, after "
                "`-O3 -march=native` and this CPU's tuning (`-DKQ_ROWS=4` on AMD's AVX-512, "
                "with `-DKQ_VECS=4` from Zen 5 on): "
                "`-mno-avx512f -mno-avxvnni` builds the AVX2 kernels on an AVX-512 CPU, as an "
                "AMD Zen 3 runs them (what `benchmarks/bench_llamacpp.py --isa avx2` compares); "
                "each set of flags is built once and cached.",
                "unset",
            ),
            Setting(
                "FURNACE_CACHE_DIR",
                "Where the native kernels are built and cached (once per machine and set of "
                "flags); the C compiler is `$CC`, else `cc`.",
                "`$XDG_CACHE_HOME/furnace-trio`, else `~/.cache/furnace-trio`",
            ),
        ),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "FURNACE_ALLOWED_HOSTS",
            "Comma-separated host names served besides `localhost`, `127.0.0.1` and `[::1]`; a "
            "request that arrives on a loopback address with any other `Host` gets 403 (DNS "
            "rebinding). Once set, the list holds on every interface; `*` allows any host. A "
            "reverse proxy on this machine that passes its own `Host` needs its name here.",
        ),
    )
    cors_origins: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "FURNACE_CORS_ORIGINS",
            "Comma-separated origins (`https://app.example`) whose pages may call the API from a "
            "browser (CORS preflights answered, `Access-Control-Allow-Origin` sent); `*` allows "
            "any. JSON endpoints accept only `Content-Type: application/json` (415 otherwise).",
        ),
    )
    config_file: str | None = field(
        default=None,
        metadata=setting(
            "FURNACE_CONFIG",
            "A TOML file of these settings, each under its variable's name without `FURNACE_` in "
            "lower case (`max_waiting = 64`), plus `[[api_keys]]`; a set variable wins over the "
            "file. Read again on `POST /admin/reload` and on SIGHUP "
            "([operations: config file](operations-config.md)).",
        ),
    )
    api_keys: tuple[APIKey, ...] = field(
        default=(),
        repr=False,
        metadata=setting(
            "[[api_keys]]",
            "Named API keys, each a table with `name`, `key` and optional `max_concurrent` "
            "(requests in flight; more get 429), accepted beside `FURNACE_API_KEY`; the name "
            "appears in the log line, `/status` and `/metrics` "
            "([operations: config file](operations-config.md)).",
            file_only=True,
        ),
    )

    def __post_init__(self) -> None:
        check_values(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServerConfig:
        """Read ``FURNACE_*`` variables (:mod:`furnace_trio.server.config_env`); unset or
        empty means the default. Raises :class:`ConfigError` naming the variable on any
        invalid value."""
        return cls(**environment_values(environ, cls()))

    @property
    def sequences_per_request(self) -> int:
        """Most sequences (prompts x n) one request may ask for: a request larger than the
        whole queue (``max_waiting``) could never be queued, so that bounds it too."""
        return min(self.max_sequences_per_request, self.max_waiting)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelName(self.log_level)  # type: ignore[no-any-return]
