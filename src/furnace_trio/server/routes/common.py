"""What every route family does with its request: read the body, check the model name."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from quart import request

from furnace_trio.server.asgi import request_config
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.errors import APIError
from furnace_trio.server.protocol import max_prompt_chars
from furnace_trio.server.state import ServerState

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend


class _Generation(Protocol):
    @property
    def model(self) -> str | None: ...


G = TypeVar("G", bound=_Generation, covariant=True)


class GenerationParser(Protocol[G]):
    """A generation endpoint's body parser (chat or completions)."""

    def __call__(self, body: bytes, *, vocab_size: int, max_prompt_chars: int | None) -> G: ...


async def read_body() -> bytes:
    """The raw body bytes (413 past ``MAX_CONTENT_LENGTH``); parsing is ours, see protocol."""
    data = await request.get_data(cache=False, as_text=False)
    return data if isinstance(data, bytes) else data.encode()


def config_of(state: ServerState) -> ServerConfig:
    """The configuration the current request arrived under (the defaults until startup has
    read it): a reload meanwhile changes nothing for this request."""
    return request_config(state)


def check_model(backend: Backend, model: str | None) -> None:
    if model is not None and model != backend.model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {backend.model_name!r}.",
            param="model",
            code="model_not_found",
        )


async def read_generation(state: ServerState, parse: GenerationParser[G]) -> tuple[Backend, G]:
    """A generation request's body, validated in a worker thread (see
    :mod:`~furnace_trio.server.off_loop`) against the serving backend (its vocabulary, its
    context and its model name)."""
    body = await read_body()
    backend = state.serving_backend()
    parsed = await state.off_loop.parse(
        partial(
            parse,
            body,
            vocab_size=backend.tokenizer.vocab_size,
            max_prompt_chars=max_prompt_chars(backend.max_context),
        )
    )
    check_model(backend, parsed.model)
    return backend, parsed
