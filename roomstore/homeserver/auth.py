"""Accounts and sessions: ``/register`` (open, ``m.login.dummy``),
``/login`` (password), ``/logout``, ``/logout/all``, ``/account/whoami``,
and the access token check every authenticated route makes.

A login makes a device (the client's ``device_id`` or a new one) and an
access token for it; a logout deletes both. Registration is open where the
server allows it (``roomstore homeserver`` opens it on loopback only unless
told otherwise): a request without ``auth`` gets the spec's 401 with the one
flow, ``m.login.dummy``.

Every authenticated request checks its token: the answers are kept in
memory (``TOKEN_CACHE_SIZE`` tokens, the oldest dropped first), as this
process is the one that deletes tokens, and a logout drops its own from the
cache once the deletion committed. That spares each request a database
round trip, under load the thread pool's queue.
"""

from __future__ import annotations

import collections
import re
import secrets

from twisted.internet import threads

from roomstore.homeserver.errors import MatrixError, bad_json, forbidden
from roomstore.homeserver.http import ClientRequest, Requester, Router
from roomstore.homeserver.passwords import check_password, hash_password
from roomstore.homeserver.tables import accounts

__all__ = ["Accounts"]

_LOCALPART = re.compile(r"[a-z0-9._=\-/+]+")
#: Access tokens whose user and device are kept in memory.
TOKEN_CACHE_SIZE = 10_000


class Accounts:
    """Users, devices and access tokens in the store's database."""

    def __init__(self, db, server_name: str, clock, registration_open: bool, on_register=None):
        self._db = db
        self._server_name = server_name
        self._clock = clock
        self._registration_open = registration_open
        self._on_register = on_register  # async (user_id, displayname): the new user's profile
        self._tokens: collections.OrderedDict[str, Requester] = collections.OrderedDict()

    def register_routes(self, router: Router) -> None:
        router.add("POST", "/register", self.register, authenticated=False)
        router.add("GET", "/register/available", self.available, authenticated=False)
        router.add("GET", "/login", self.login_flows, authenticated=False)
        router.add("POST", "/login", self.login, authenticated=False)
        router.add("POST", "/logout", self.logout)
        router.add("POST", "/logout/all", self.logout_all)
        router.add("GET", "/account/whoami", self.whoami)

    def _now(self) -> int:
        return int(self._clock.seconds() * 1000)

    async def authenticate(self, token: str) -> Requester:
        known = self._tokens.get(token)
        if known is not None:
            return known
        found = await self._db.run_interaction("hs_user_for_token", accounts.user_for_token_txn, token)
        if found is None:
            raise MatrixError(401, "M_UNKNOWN_TOKEN", "Invalid access token passed.", soft_logout=False)
        requester = Requester(found[0], found[1], token)
        self._tokens[token] = requester
        while len(self._tokens) > TOKEN_CACHE_SIZE:
            self._tokens.popitem(last=False)
        return requester

    def _forget_tokens(self, user_id: str, device_id: str | None = None) -> None:
        """Drop the cached tokens of a user (of one device) whose tokens were deleted."""
        for token, requester in list(self._tokens.items()):
            if requester.user_id == user_id and device_id in (None, requester.device_id):
                del self._tokens[token]

    async def is_admin(self, user_id: str) -> bool:
        """Whether ``user_id`` is a server admin (read each time: admin calls are rare)."""
        return await self._db.run_interaction("hs_is_admin", accounts.is_admin_txn, user_id)

    async def set_admin(self, user_id: str, admin: bool = True) -> bool:
        """Make ``user_id`` a server admin (or not); False when no such user is registered."""
        return await self._db.run_interaction("hs_set_admin", accounts.set_admin_txn, user_id, admin)

    def _user_id(self, name: str) -> str:
        """A full user ID from a localpart or a user ID of this server."""
        if name.startswith("@"):
            localpart, _, server = name[1:].partition(":")
            if server != self._server_name:
                raise forbidden(f"{name} is not a user of {self._server_name}")
            name = localpart
        return f"@{name.lower()}:{self._server_name}"

    async def available(self, request: ClientRequest) -> dict:
        user_id = self._user_id(request.arg("username") or "")
        if await self._db.run_interaction("hs_user_exists", accounts.user_exists_txn, user_id):
            raise MatrixError(400, "M_USER_IN_USE", "User ID already taken.")
        return {"available": True}

    async def register(self, request: ClientRequest):
        body = request.body
        if request.arg("kind", "user") != "user":
            raise MatrixError(403, "M_GUEST_ACCESS_FORBIDDEN", "Guest access is disabled")
        if not self._registration_open:
            raise forbidden("Registration has been disabled")
        if (body.get("auth") or {}).get("type") != "m.login.dummy":
            return 401, {"flows": [{"stages": ["m.login.dummy"]}], "params": {}, "session": secrets.token_hex(8)}
        localpart, password = body.get("username") or secrets.token_hex(6), body.get("password")
        if not isinstance(localpart, str) or not _LOCALPART.fullmatch(localpart.lower()):
            raise MatrixError(400, "M_INVALID_USERNAME", "User ID may contain only a-z, 0-9, and ._=-/+")
        if not isinstance(password, str) or not password:
            raise bad_json("password must be a non-empty string")
        user_id = self._user_id(localpart)
        hashed = await threads.deferToThread(hash_password, password)
        if not await self._db.run_interaction("hs_add_user", accounts.add_user_txn, user_id, hashed, self._now()):
            raise MatrixError(400, "M_USER_IN_USE", "User ID already taken.")
        if self._on_register is not None:
            await self._on_register(user_id, localpart)
        if body.get("inhibit_login"):
            return {"user_id": user_id, "home_server": self._server_name}
        return await self._new_session(user_id, body.get("device_id"), body.get("initial_device_display_name"))

    async def login_flows(self, request: ClientRequest) -> dict:
        return {"flows": [{"type": "m.login.password"}]}

    async def login(self, request: ClientRequest) -> dict:
        body = request.body
        if body.get("type") != "m.login.password":
            raise MatrixError(400, "M_UNKNOWN", f"Unknown login type {body.get('type')!r}")
        identifier = body.get("identifier") or {"type": "m.id.user", "user": body.get("user")}
        if not isinstance(identifier, dict) or identifier.get("type") != "m.id.user":
            raise bad_json("identifier must be of type m.id.user")
        name, password = identifier.get("user"), body.get("password")
        if not isinstance(name, str) or not isinstance(password, str):
            raise bad_json("user and password must be strings")
        try:
            user_id = self._user_id(name)
        except MatrixError:
            raise forbidden("Invalid username or password") from None
        stored = await self._db.run_interaction("hs_password_hash", accounts.password_hash_txn, user_id)
        if stored is None or not await threads.deferToThread(check_password, password, stored):
            raise forbidden("Invalid username or password")
        return await self._new_session(user_id, body.get("device_id"), body.get("initial_device_display_name"))

    async def _new_session(self, user_id: str, device_id, display_name) -> dict:
        if not isinstance(device_id, str) or not device_id:
            device_id = secrets.token_hex(5).upper()
        token = "syt_" + secrets.token_urlsafe(32)

        def write(txn):
            accounts.add_device_txn(txn, user_id, device_id, display_name, self._now())
            accounts.add_token_txn(txn, token, user_id, device_id, self._now())

        await self._db.run_interaction("hs_new_session", write)
        return {"user_id": user_id, "access_token": token, "device_id": device_id, "home_server": self._server_name}

    async def logout(self, request: ClientRequest) -> dict:
        user = request.user
        await self._db.run_interaction("hs_logout", accounts.delete_device_tokens_txn, user.user_id, user.device_id)
        self._forget_tokens(user.user_id, user.device_id)
        return {}

    async def logout_all(self, request: ClientRequest) -> dict:
        await self._db.run_interaction("hs_logout_all", accounts.delete_user_tokens_txn, request.user.user_id)
        self._forget_tokens(request.user.user_id)
        return {}

    async def whoami(self, request: ClientRequest) -> dict:
        return {"user_id": request.user.user_id, "device_id": request.user.device_id, "is_guest": False}
