"""The HTTP face: one ``twisted.web`` resource under ``/_matrix/client``
that routes ``(method, path)`` to an ``async`` handler and writes its JSON.

Handlers are registered on a :class:`Router` with a path pattern
(``/rooms/{roomId}/send/{eventType}/{txnId}``, each ``{name}`` one
percent-decoded segment) under every client API prefix (``v3``, ``r0``,
``unstable``). A handler gets a :class:`ClientRequest` and returns a JSON
object (200) or ``(status, object)``; a :class:`MatrixError` it raises
becomes the spec's error body with its status, anything else a 500
``M_UNKNOWN`` (logged). An unknown path is 404 ``M_UNRECOGNIZED``, a known one
with another method 405 ``M_UNRECOGNIZED``; a body that is not JSON 400
``M_NOT_JSON``, JSON that is not an object 400 ``M_BAD_JSON``.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
from twisted.internet import defer
from twisted.logger import Logger
from twisted.web import resource, server

from roomstore.events import InvalidToken
from roomstore.homeserver.errors import MatrixError
from roomstore.storage import NotFoundError

__all__ = ["ClientRequest", "ClientResource", "Requester", "Router"]

log = Logger()

#: Longest first: ``/_matrix/client`` itself is the prefix of ``/versions``.
PREFIXES = (
    "/_matrix/client/v3",
    "/_matrix/client/r0",
    "/_matrix/client/unstable",
    "/_matrix/client/v1",
    "/_matrix/client",
)
_SEGMENT = re.compile(r"\{([A-Za-z_]+)\}")


@attrs.frozen
class Requester:
    """Who a request comes from: the access token's user and device."""

    user_id: str
    device_id: str
    access_token: str


@attrs.frozen
class ClientRequest:
    """What a handler sees: the path's parameters, the query, the JSON body
    (``{}`` when there is none) and the requester (None on open endpoints)."""

    params: dict[str, str]
    query: dict[str, list[str]]
    body: dict
    requester: Requester | None
    http: Any  # the twisted.web request, for notifyFinish

    def arg(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def int_arg(self, name: str, default: int) -> int:
        text = self.arg(name)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise MatrixError(400, "M_INVALID_PARAM", f"{name} must be an integer, not {text!r}") from None

    @property
    def user(self) -> Requester:
        assert self.requester is not None, "an authenticated route"
        return self.requester


Handler = Callable[[ClientRequest], Awaitable[Any]]


@attrs.frozen
class Route:
    method: str
    pattern: re.Pattern
    handler: Handler
    authenticated: bool


class Router:
    """``(method, path)`` -> handler; see the module docstring."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(self, method: str, path: str, handler: Handler, authenticated: bool = True) -> None:
        regex = "".join(
            f"(?P<{part}>[^/]+)" if i % 2 else re.escape(part) for i, part in enumerate(_SEGMENT.split(path))
        )
        self._routes.append(Route(method, re.compile(regex + "/?"), handler, authenticated))

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        known_path = False
        for route in self._routes:
            found = route.pattern.fullmatch(path)
            if found is None:
                continue
            if route.method == method:
                return route, {k: urllib.parse.unquote(v) for k, v in found.groupdict().items()}
            known_path = True
        if known_path:
            raise MatrixError(405, "M_UNRECOGNIZED", f"{method} is not allowed on {path}")
        raise MatrixError(404, "M_UNRECOGNIZED", "Unrecognized request")


def _body(request) -> dict:
    raw = request.content.read() if request.content is not None else b""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise MatrixError(400, "M_NOT_JSON", "Content not JSON.") from None
    if not isinstance(body, dict):
        raise MatrixError(400, "M_BAD_JSON", "Content must be a JSON object.")
    return body


def access_token(request) -> str | None:
    """The token of the ``Authorization: Bearer`` header, or ``?access_token=``."""
    header = request.getHeader("authorization")
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    values = request.args.get(b"access_token")
    return values[-1].decode("utf-8", "replace") if values else None


class ClientResource(resource.Resource):
    """Every ``/_matrix/client`` request, answered by the router's handlers.

    ``authenticate(token)`` (async) gives the token's :class:`Requester` or
    raises ``M_UNKNOWN_TOKEN``; the resource asks it on every route that
    needs a user."""

    isLeaf = True

    def __init__(
        self,
        router: Router,
        authenticate: Callable[[str], Awaitable[Requester]],
        prefixes: tuple[str, ...] = PREFIXES,
    ):
        super().__init__()
        self._router = router
        self._authenticate = authenticate
        self._prefixes = prefixes

    def render(self, request):
        _cors(request)
        if request.method == b"OPTIONS":
            return b"{}"
        gone: list = []
        request.notifyFinish().addBoth(gone.append)  # fires early only if the client goes away
        defer.ensureDeferred(self._answer(request, gone))
        return server.NOT_DONE_YET

    async def _answer(self, request, gone: list) -> None:
        try:
            status, body = await self._dispatch(request)
        except MatrixError as exc:
            status, body = exc.status, exc.to_json()
        except InvalidToken as exc:  # a from/since/to token this server never issued
            status, body = 400, MatrixError(400, "M_INVALID_PARAM", str(exc)).to_json()
        except NotFoundError as exc:  # an ID the store does not hold
            status, body = 404, MatrixError(404, "M_NOT_FOUND", str(exc)).to_json()
        except Exception:
            log.failure("{method} {path} failed", method=request.method, path=request.path)
            status, body = 500, {"errcode": "M_UNKNOWN", "error": "Internal server error"}
        if not gone:  # a client that left (a long-poll given up) has nothing to write to
            _respond(request, status, body)

    async def _dispatch(self, request) -> tuple[int, Any]:
        path = request.path.decode("utf-8", "replace")
        prefix = next((p for p in self._prefixes if path == p or path.startswith(p + "/")), None)
        if prefix is None:
            raise MatrixError(404, "M_UNRECOGNIZED", "Unrecognized request")
        route, params = self._router.match(request.method.decode("ascii", "replace"), path[len(prefix) :])
        requester = None
        if route.authenticated:
            token = access_token(request)
            if token is None:
                raise MatrixError(401, "M_MISSING_TOKEN", "Missing access token")
            requester = await self._authenticate(token)
        body = _body(request) if request.method in (b"POST", b"PUT") else {}
        query = {
            k.decode("utf-8", "replace"): [v.decode("utf-8", "replace") for v in vs] for k, vs in request.args.items()
        }
        result = await route.handler(ClientRequest(params, query, body, requester, request))
        return result if isinstance(result, tuple) else (200, result)


class NotFoundResource(resource.Resource):
    """Any path outside ``/_matrix/client``: ``M_UNRECOGNIZED``, as JSON."""

    def getChild(self, path, request):
        return self

    def render(self, request):
        _cors(request)
        request.setResponseCode(404)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"}).encode()


def site_root(client: ClientResource, admin: ClientResource | None = None) -> resource.Resource:
    """The resource tree: ``/_matrix/client`` -> ``client``, ``/_synapse/admin``
    -> ``admin`` (the admin API, at the paths Synapse serves it), the rest 404."""
    root = NotFoundResource()
    matrix = NotFoundResource()
    root.putChild(b"_matrix", matrix)
    matrix.putChild(b"client", client)
    if admin is not None:
        synapse = NotFoundResource()
        root.putChild(b"_synapse", synapse)
        synapse.putChild(b"admin", admin)
    return root


def _cors(request) -> None:
    request.setHeader(b"access-control-allow-origin", b"*")
    request.setHeader(b"access-control-allow-methods", b"GET, HEAD, POST, PUT, DELETE, OPTIONS")
    request.setHeader(b"access-control-allow-headers", b"X-Requested-With, Content-Type, Authorization")


def _encode_json(body: Any) -> bytes:
    """``body`` as UTF-8 JSON: orjson (several times faster than ``json`` on
    a page of events, the bulk of a /sync or /messages answer), or ``json``
    for what orjson refuses (an integer beyond 64 bits, a lone surrogate)."""
    try:
        return orjson.dumps(body)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(body).encode("ascii")


def _respond(request, status: int, body: Any) -> None:
    data = _encode_json(body)
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", str(len(data)).encode("ascii"))
    request.write(data)
    request.finish()
