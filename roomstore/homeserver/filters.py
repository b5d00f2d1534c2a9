"""Filters: ``POST /user/{userId}/filter`` and ``GET .../filter/{id}`` (kept
in ``hs_filters``), and what ``/sync`` and ``/messages`` make of a filter:
:class:`EventFilter` (``types``/``not_types`` with ``*`` wildcards,
``senders``/``not_senders``, ``rooms``/``not_rooms``, ``limit``) and
:class:`SyncFilter` (its ``room.timeline``, ``room.rooms``/``not_rooms``,
``room.include_leave``). Unknown fields are kept and ignored, as the spec asks.
"""

from __future__ import annotations

import fnmatch
import json

import attrs

from roomstore.homeserver.errors import MatrixError, bad_json, forbidden, not_found
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.homeserver.tables import filters as filter_table

__all__ = ["EventFilter", "Filters", "SyncFilter"]

DEFAULT_TIMELINE_LIMIT = 10


def _strings(value, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_json(f"{name} must be a list of strings")
    return tuple(value)


def _matches(value: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(value, pattern) if "*" in pattern else value == pattern for pattern in patterns)


@attrs.frozen
class EventFilter:
    """A RoomEventFilter: which events pass, and how many."""

    types: tuple[str, ...] | None = None
    not_types: tuple[str, ...] = ()
    senders: tuple[str, ...] | None = None
    not_senders: tuple[str, ...] = ()
    rooms: tuple[str, ...] | None = None
    not_rooms: tuple[str, ...] = ()
    limit: int | None = None

    @classmethod
    def from_json(cls, data) -> EventFilter:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise bad_json("a filter must be a JSON object")
        limit = data.get("limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise bad_json("limit must be a non-negative integer")
        return cls(
            _strings(data.get("types"), "types"),
            _strings(data.get("not_types"), "not_types") or (),
            _strings(data.get("senders"), "senders"),
            _strings(data.get("not_senders"), "not_senders") or (),
            _strings(data.get("rooms"), "rooms"),
            _strings(data.get("not_rooms"), "not_rooms") or (),
            limit,
        )

    def allows_room(self, room_id: str) -> bool:
        return room_id not in self.not_rooms and (self.rooms is None or room_id in self.rooms)

    def allows(self, event: dict) -> bool:
        event_type, sender = event.get("type", ""), event.get("sender", "")
        if _matches(event_type, self.not_types) or (self.types is not None and not _matches(event_type, self.types)):
            return False
        if sender in self.not_senders or (self.senders is not None and sender not in self.senders):
            return False
        return True

    def apply(self, events: list[dict]) -> list[dict]:
        return [event for event in events if self.allows(event)]


@attrs.frozen
class SyncFilter:
    """What ``/sync`` uses of a Filter."""

    timeline: EventFilter = EventFilter()
    rooms: EventFilter = EventFilter()
    include_leave: bool = False

    @property
    def timeline_limit(self) -> int:
        return DEFAULT_TIMELINE_LIMIT if self.timeline.limit is None else self.timeline.limit

    @classmethod
    def from_json(cls, data) -> SyncFilter:
        if not isinstance(data, dict):
            raise bad_json("a filter must be a JSON object")
        room = data.get("room") or {}
        if not isinstance(room, dict):
            raise bad_json("filter.room must be an object")
        return cls(
            EventFilter.from_json(room.get("timeline")),
            EventFilter(
                rooms=_strings(room.get("rooms"), "rooms"), not_rooms=_strings(room.get("not_rooms"), "not_rooms") or ()
            ),
            bool(room.get("include_leave", False)),
        )


def parse_json_param(text: str, name: str):
    try:
        return json.loads(text)
    except ValueError:
        raise MatrixError(400, "M_NOT_JSON", f"{name} is not JSON") from None


class Filters:
    """The filter endpoints, and a sync request's filter (an ID or inline JSON)."""

    def __init__(self, db):
        self._db = db

    def register_routes(self, router: Router) -> None:
        router.add("POST", "/user/{userId}/filter", self.create)
        router.add("GET", "/user/{userId}/filter/{filterId}", self.get)

    def _own(self, request: ClientRequest) -> str:
        if request.params["userId"] != request.user.user_id:
            raise forbidden("Cannot create or read filters for other users")
        return request.user.user_id

    async def create(self, request: ClientRequest) -> dict:
        user_id = self._own(request)
        SyncFilter.from_json(request.body)  # refuse what /sync would refuse
        filter_id = await self._db.run_interaction(
            "hs_add_filter", filter_table.add_filter_txn, user_id, json.dumps(request.body)
        )
        return {"filter_id": str(filter_id)}

    async def _load(self, user_id: str, filter_id: str) -> dict:
        stored = None
        if filter_id.isdigit():
            stored = await self._db.run_interaction(
                "hs_get_filter", filter_table.get_filter_txn, user_id, int(filter_id)
            )
        if stored is None:
            raise not_found(f"No filter {filter_id!r}")
        return json.loads(stored)

    async def get(self, request: ClientRequest) -> dict:
        return await self._load(self._own(request), request.params["filterId"])

    async def sync_filter(self, user_id: str, param: str | None) -> SyncFilter:
        """``/sync``'s ``filter``: inline JSON (it starts with ``{``) or a filter ID."""
        if param is None:
            return SyncFilter()
        data = parse_json_param(param, "filter") if param.lstrip().startswith("{") else await self._load(user_id, param)
        return SyncFilter.from_json(data)
