"""The admin API, at the paths and in the shapes Synapse serves it, for server
admins only (``hs_users.admin``: ``roomstore homeserver --make-admin``);
anyone else gets 403 ``M_FORBIDDEN``:

* ``POST /_synapse/admin/v1/purge_history/{roomId}[/{eventId}]``, body
  ``{"purge_up_to_event_id": ...}`` (or the event in the path: the events
  before it go, it stays) or ``{"purge_up_to_ts": ms}`` (the events up to the
  newest one sent before then go), ``"delete_local_events"`` (default false:
  this server's users' events stay as outliers): ``{"purge_id": ...}``;
* ``GET /_synapse/admin/v1/purge_history_status/{purgeId}``: ``status``
  (``active``, ``complete``, ``failed``) and, once complete, what
  ``RoomStore.purge_history`` removed (``PurgeResult.as_json``: rows per
  table, state groups, events kept as outliers);
* ``DELETE /_synapse/admin/v2/rooms/{roomId}`` (body ``purge``, default
  true; only purging is offered): ``RoomStore.purge_room``, ``{"delete_id":
  ...}``; ``GET /_synapse/admin/v2/rooms/delete_status/{deleteId}`` and
  ``GET /_synapse/admin/v2/rooms/{roomId}/delete_status`` its status.

A purge runs in the background, as Synapse's do, each in the store's one
transaction; its status is kept in memory (a restart forgets it). Clients go
on syncing and sending meanwhile: the store serves each read from before or
after the purge, never half of it.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs
from twisted.internet import defer
from twisted.logger import Logger

from roomstore.events import TopologicalToken
from roomstore.homeserver.errors import MatrixError, bad_json, forbidden, not_found
from roomstore.homeserver.http import ClientRequest, Router

__all__ = ["ADMIN_PREFIXES", "Admin"]

log = Logger()

#: Under ``/_synapse/admin``: the routes name their own version (``/v1/...``, ``/v2/...``).
ADMIN_PREFIXES = ("/_synapse/admin",)
#: Events read per step when looking for the point of a ``purge_up_to_ts``; doubled each step.
_TS_SEARCH_STEP = 200


@attrs.define
class _Task:
    """One purge: what it was asked, and how it went."""

    task_id: str
    kind: str  # "purge_history" or "purge_room"
    room_id: str
    status: str = "active"
    result: dict | None = None
    error: str | None = None


class Admin:
    """The admin routes; ``accounts`` answers who is an admin."""

    def __init__(self, store, accounts):
        self._store = store
        self._accounts = accounts
        self._tasks: dict[str, _Task] = {}

    def register_routes(self, router: Router) -> None:
        router.add("POST", "/v1/purge_history/{roomId}", self.purge_history)
        router.add("POST", "/v1/purge_history/{roomId}/{eventId}", self.purge_history)
        router.add("GET", "/v1/purge_history_status/{purgeId}", self.purge_history_status)
        router.add("GET", "/v2/rooms/delete_status/{deleteId}", self.delete_status)
        router.add("GET", "/v2/rooms/{roomId}/delete_status", self.room_delete_status)
        router.add("DELETE", "/v2/rooms/{roomId}", self.delete_room)

    async def _require_admin(self, request: ClientRequest) -> None:
        if not await self._accounts.is_admin(request.user.user_id):
            raise forbidden("You are not a server admin")

    async def purge_history(self, request: ClientRequest) -> dict:
        await self._require_admin(request)
        room_id, body = request.params["roomId"], request.body
        delete_local = body.get("delete_local_events", False)
        if not isinstance(delete_local, bool):
            raise bad_json("delete_local_events must be a boolean")
        if await self._store.get_room_version(room_id) is None:
            raise not_found(f"Unknown room {room_id}")
        event_id = request.params.get("eventId") or body.get("purge_up_to_event_id")
        if event_id is not None:
            token = await self._before_event(room_id, event_id)
        elif "purge_up_to_ts" in body:
            token = await self._up_to_ts(room_id, body["purge_up_to_ts"])
        else:
            raise bad_json("must specify purge_up_to_event_id or purge_up_to_ts")
        task = self._start("purge_history", room_id, self._store.purge_history, room_id, token, delete_local)
        return {"purge_id": task.task_id}

    async def _before_event(self, room_id: str, event_id) -> str:
        """The position just before the event: the events before it go, it stays."""
        event = await self._store.get_event(event_id) if isinstance(event_id, str) else None
        if event is None:
            raise not_found(f"Unknown event {event_id}")
        if event.get("room_id") != room_id:
            raise MatrixError(400, "M_UNKNOWN", "Event is for wrong room.")
        after = TopologicalToken.parse(await self._store.get_topological_token(event_id))
        return TopologicalToken(after.topological, after.stream - 1).to_string()

    async def _up_to_ts(self, room_id: str, ts) -> str:
        """The position just after the room's newest event (in topological
        order) sent before ``ts``, read back from the room's newest events
        (``RoomStore.backfill``, a server's view: every event, whoever may see it)."""
        if type(ts) is not int:
            raise bad_json("purge_up_to_ts must be an int")
        extremities = await self._store.get_forward_extremities(room_id)
        limit = _TS_SEARCH_STEP
        while True:
            events = await self._store.backfill(room_id, extremities, limit)  # oldest first
            before = [event for event in events if event.get("origin_server_ts", ts) < ts]
            if before:
                return await self._store.get_topological_token(before[-1]["event_id"])
            if len(events) < limit:
                raise not_found("there is no event to be purged")
            limit *= 2

    async def purge_history_status(self, request: ClientRequest) -> dict:
        await self._require_admin(request)
        task = self._tasks.get(request.params["purgeId"])
        if task is None or task.kind != "purge_history":
            raise not_found(f"purge id '{request.params['purgeId']}' not found")
        answer = {"status": task.status}
        if task.result is not None:
            answer.update(task.result)
        if task.error is not None:
            answer["error"] = task.error
        return answer

    async def delete_room(self, request: ClientRequest) -> dict:
        await self._require_admin(request)
        room_id = request.params["roomId"]
        if not room_id.startswith("!"):
            raise MatrixError(400, "M_INVALID_PARAM", f"{room_id} is not a legal room ID")
        if request.body.get("purge", True) is not True:
            raise MatrixError(400, "M_INVALID_PARAM", "only purging a room is supported: purge must be true")
        task = self._start("purge_room", room_id, self._store.purge_room, room_id)
        return {"delete_id": task.task_id}

    def _delete_answer(self, task: _Task) -> dict:
        answer: dict[str, Any] = {"delete_id": task.task_id, "room_id": task.room_id, "status": task.status}
        if task.result is not None:
            answer["purge"] = task.result
        if task.error is not None:
            answer["error"] = task.error
        return answer

    async def delete_status(self, request: ClientRequest) -> dict:
        await self._require_admin(request)
        task = self._tasks.get(request.params["deleteId"])
        if task is None or task.kind != "purge_room":
            raise not_found(f"delete id '{request.params['deleteId']}' not found")
        return self._delete_answer(task)

    async def room_delete_status(self, request: ClientRequest) -> dict:
        await self._require_admin(request)
        room_id = request.params["roomId"]
        tasks = [t for t in self._tasks.values() if t.kind == "purge_room" and t.room_id == room_id]
        if not tasks:
            raise not_found(f"No delete task for room_id '{room_id}' found")
        return {"results": [self._delete_answer(task) for task in tasks]}

    def _start(self, kind: str, room_id: str, purge, *args) -> _Task:
        """Run ``purge(*args)`` in the background; its task, ``active`` until it ends."""
        task = _Task(secrets.token_urlsafe(12), kind, room_id)
        self._tasks[task.task_id] = task

        async def run() -> None:
            try:
                result = await purge(*args)
            except Exception as exc:
                task.status, task.error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.failure("{kind} of {room_id} failed", kind=kind, room_id=room_id)
            else:
                task.status, task.result = "complete", result.as_json()

        defer.ensureDeferred(run())
        return task
