"""A homeserver on a real loopback port, in the test process, and a client
that talks to it over real HTTP (urllib, on a thread: the reactor serves the
request meanwhile)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

from twisted.internet import defer, reactor, threads

from roomstore.homeserver import Homeserver

SERVER_NAME = "test.local"


def http_request(url: str, method: str, body: bytes | None, headers: dict, timeout: float) -> tuple[int, object]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, data = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, data = exc.code, exc.read()
    return status, json.loads(data) if data else None


class Client:
    """One user's session: ``call`` returns ``(status, json)``."""

    def __init__(self, base: str, token: str | None = None, user_id: str | None = None):
        self.base = base
        self.token = token
        self.user_id = user_id

    async def call(
        self,
        method: str,
        path: str,
        body=None,
        query: dict | None = None,
        raw: bytes | None = None,
        token: str | None = None,
        prefix: str = "/_matrix/client/v3",
        timeout: float = 30,
    ):
        url = self.base + prefix + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = {"Content-Type": "application/json"}
        token = token or self.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        return await threads.deferToThread(http_request, url, method, data, headers, timeout)

    async def ok(self, method: str, path: str, body=None, **kwargs):
        """``call``, which must answer 200; its JSON."""
        status, answer = await self.call(method, path, body, **kwargs)
        if status != 200:
            raise AssertionError(f"{method} {path}: {status} {answer}")
        return answer

    async def send(self, room_id: str, txn_id: str, body: str) -> str:
        path = f"/rooms/{quote(room_id)}/send/m.room.message/{txn_id}"
        return (await self.ok("PUT", path, {"msgtype": "m.text", "body": body}))["event_id"]


def quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")


class HomeserverMixin:
    """With ``DatabaseTestMixin`` (``tests.db.on_both_engines``): a homeserver
    on a fresh database of the test's engine, listening on a free port."""

    async def start_homeserver(self) -> str:
        hs = await Homeserver.open(self.new_database_url(), SERVER_NAME, reactor=reactor)
        port = hs.listen(0, "127.0.0.1", reactor)
        self.addCleanup(hs.close)
        self.addCleanup(port.stopListening)
        self.hs = hs
        self.base = f"http://127.0.0.1:{port.getHost().port}"
        return self.base

    async def register(self, name: str, password: str = "secret") -> Client:
        client = Client(self.base)
        answer = await client.ok(
            "POST", "/register", {"username": name, "password": password, "auth": {"type": "m.login.dummy"}}
        )
        return Client(self.base, answer["access_token"], answer["user_id"])


async def sleep(seconds: float) -> None:
    d = defer.Deferred()
    reactor.callLater(seconds, d.callback, None)
    await d


def monotonic() -> float:
    return time.monotonic()
