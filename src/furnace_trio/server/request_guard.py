"""What a web page in the user's browser can make this server do: nothing, unless allowed.

A server on ``127.0.0.1`` with no API key is reachable by every page the user opens:

- *Cross-site requests.* A page may POST to any address without asking first when the
  body is a "simple" content type (``text/plain``, a form). JSON endpoints therefore
  accept only ``application/json`` (parameters such as ``charset`` are fine) and answer
  anything else with 415: a browser sends ``application/json`` cross-origin only after a
  CORS preflight, which this server answers for the configured origins alone.
- *DNS rebinding.* A page on ``evil.example`` can have its name resolve to ``127.0.0.1``
  and then read every answer as same-origin; its requests still say
  ``Host: evil.example``. A request that arrives on a loopback address must name a
  loopback host (``localhost``, ``127.0.0.1``, ``[::1]``, any port) or one listed in
  ``FURNACE_ALLOWED_HOSTS``; when that list is set it holds on every interface. ``*``
  lets any host through.
- *CORS.* Only origins listed in ``FURNACE_CORS_ORIGINS`` (``*``: any) get
  ``Access-Control-Allow-Origin`` and their preflights answered; for others the browser
  keeps the answer from the page.

The checks are pure functions; :func:`register` hooks them in before every other
``before_request`` (the API key check included), so refusals are OpenAI error objects.
Whether the server listens on loopback is read per connection from the address the
request arrived on (the ASGI scope's ``server``), whatever the bind configuration says.
"""

from __future__ import annotations

import ipaddress

from quart import Response, request
from quart_trio import QuartTrio

from furnace_trio.server.config import ServerConfig
from furnace_trio.server.errors import APIError
from furnace_trio.server.state import ServerState

__all__ = [
    "host_allowed",
    "is_json_content_type",
    "is_loopback_address",
    "origin_allowed",
    "register",
]

#: Methods whose body this server reads as JSON.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: Response headers a cross-origin page may read besides the safelisted ones.
EXPOSED_HEADERS = "X-Session-Id, Retry-After, x-should-retry"
PREFLIGHT_MAX_AGE_S = 600


def is_json_content_type(value: str | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    if value is None:
        return False
    return value.split(";", 1)[0].strip().lower() == "application/json"


def is_loopback_address(address: str) -> bool:
    """Whether an IP address (as the socket reports it) is a loopback one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def host_name(host: str) -> str:
    """The name of a ``Host`` header, without port or IPv6 brackets, lowercase."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _loopback_name(name: str) -> bool:
    return name == "localhost" or is_loopback_address(name)


def host_allowed(host: str | None, local_address: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this ``Host`` header, arriving on ``local_address``, is
    served: on loopback (or everywhere once ``allowed`` lists names) the host must be a
    loopback name or in ``allowed``. No ``Host`` (HTTP/1.0) is not a browser: served."""
    if host is None or "*" in allowed:
        return True
    if not allowed and not (local_address is not None and is_loopback_address(local_address)):
        return True
    name = host_name(host)
    return _loopback_name(name) or any(name == host_name(entry) for entry in allowed)


def origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether the page at ``origin`` may read answers (CORS)."""
    if origin is None:
        return False
    return "*" in allowed or origin.strip().lower().rstrip("/") in allowed


def _cors_headers(origin: str) -> dict[str, str]:
    return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": EXPOSED_HEADERS}


def _config(state: ServerState) -> ServerConfig:
    return state.config if state.config is not None else ServerConfig()


def register(app: QuartTrio, state: ServerState) -> None:
    """Check Host and Content-Type before any route (register it first), answer CORS
    preflights, and add CORS headers for allowed origins."""

    @app.before_request
    async def guard() -> Response | None:
        cfg = _config(state)
        server = request.scope.get("server")
        local = str(server[0]) if server else None
        host = request.headers.get("Host")
        if not host_allowed(host, local, cfg.allowed_hosts):
            raise APIError(
                403,
                f"The Host {host!r} is not a name of this server: on loopback it answers "
                "localhost, 127.0.0.1 and [::1] only. List other names in "
                "FURNACE_ALLOWED_HOSTS.",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if origin is None or not origin_allowed(origin, cfg.cors_origins):
                raise APIError(
                    403,
                    f"Cross-origin requests from {origin!r} are not allowed; list the "
                    "origin in FURNACE_CORS_ORIGINS.",
                    code="origin_not_allowed",
                )
            headers = _cors_headers(origin)
            headers.update(
                {
                    "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
                    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get(
                        "Access-Control-Request-Headers", "Authorization, Content-Type"
                    ),
                    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                }
            )
            return Response(b"", status=204, headers=headers)
        if (
            request.method in BODY_METHODS
            and request.routing_exception is None  # a route takes it (else 404 or 405)
            and not is_json_content_type(request.headers.get("Content-Type"))
        ):
            given = request.headers.get("Content-Type")
            what = "No Content-Type" if given is None else f"Content-Type {given!r}"
            raise APIError(
                415,
                f"{what}: send the request body as JSON, with Content-Type: application/json.",
                code="unsupported_media_type",
            )
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        cfg = _config(state)
        if not cfg.cors_origins:
            return response
        response.vary.add("Origin")  # the answer depends on it, for caches between
        origin = request.headers.get("Origin")
        if origin is not None and origin_allowed(origin, cfg.cors_origins):
            for key, value in _cors_headers(origin).items():
                response.headers.setdefault(key, value)
        return response
