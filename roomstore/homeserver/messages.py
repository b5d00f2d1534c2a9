"""History: ``GET /rooms/{id}/messages`` (pages of the timeline, ``dir`` b
or f, ``from``, ``to``, ``limit``, a ``filter``) and
``GET /rooms/{id}/context/{eventId}`` (an event with the events around it).

Pages come from ``RoomStore.paginate``, which serves only what the user may
see; a filter's ``types``/``not_types``/``senders`` thin a page, so more pages
are read until ``limit`` events pass or the room has no more. ``from`` may
be a ``prev_batch`` or ``end`` token, or a sync's ``next_batch``; none: the
room's end (``b``) or start (``f``)."""

from __future__ import annotations

import functools

from roomstore.events import TopologicalToken
from roomstore.homeserver.client_events import format_for_client
from roomstore.homeserver.errors import MatrixError, not_found
from roomstore.homeserver.events import events_in_order
from roomstore.homeserver.filters import EventFilter, parse_json_param
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.homeserver.room_state import state_for_user

__all__ = ["History"]

MAX_LIMIT = 1000
#: Pages read for one request at most, however much the filter drops.
MAX_PAGES = 20


class History:
    def __init__(self, store):
        self._store = store

    def register_routes(self, router: Router) -> None:
        router.add("GET", "/rooms/{roomId}/messages", self.messages)
        router.add("GET", "/rooms/{roomId}/context/{eventId}", self.context)

    def _filter(self, request: ClientRequest) -> EventFilter:
        text = request.arg("filter")
        return EventFilter() if text is None else EventFilter.from_json(parse_json_param(text, "filter"))

    async def _page(
        self,
        room_id: str,
        user_id: str,
        start: str | None,
        direction: str,
        limit: int,
        event_filter: EventFilter,
        stop_before: str | None = None,
    ) -> tuple[list[dict], str | None]:
        """At most ``limit`` events passing the filter, and the token after the last read."""
        chosen: list[dict] = []
        token = start
        for _ in range(MAX_PAGES):
            wanted = limit - len(chosen)
            page = await self._store.paginate(room_id, user_id, token, direction, wanted)
            if not page.events:
                return chosen, token if token != start else None
            for event in page.events:
                if stop_before is not None and await self._passed(event, stop_before, direction):
                    return chosen, None
                if event_filter.allows(event):
                    chosen.append(event)
            token = page.next_token
            # A page short of what was asked is the last visible one that way:
            # asking again would cost a turn of the pool for an empty page.
            if len(chosen) >= limit or len(page.events) < wanted:
                break
        return chosen, token

    async def _passed(self, event: dict, to: str, direction: str) -> bool:
        """Whether ``event`` lies beyond the ``to`` token (topological tokens only)."""
        if not to.startswith("t"):
            return False
        here = TopologicalToken.parse(await self._store.get_topological_token(event["event_id"])).as_tuple()
        bound = TopologicalToken.parse(to).as_tuple()
        return here <= bound if direction == "b" else here > bound

    async def messages(self, request: ClientRequest) -> dict:
        room_id, user_id = request.params["roomId"], request.user.user_id
        if await self._store.get_room_version(room_id) is None:
            raise not_found(f"Unknown room {room_id}")
        direction = request.arg("dir", "b")
        if direction not in ("b", "f"):
            raise MatrixError(400, "M_INVALID_PARAM", "dir must be 'b' or 'f'")
        limit = min(max(request.int_arg("limit", 10), 1), MAX_LIMIT)
        start = request.arg("from")
        events, end = await self._page(
            room_id, user_id, start, direction, limit, self._filter(request), request.arg("to")
        )
        body = {
            "chunk": await format_for_client(self._store, events, request.user),
            "start": start or self._store.get_current_token(),
        }
        if end is not None and events:
            body["end"] = end
        return body

    async def context(self, request: ClientRequest) -> dict:
        room_id, user_id, event_id = request.params["roomId"], request.user.user_id, request.params["eventId"]
        event = await self._store.get_event(event_id)
        if event is None or event.get("room_id") != room_id or not await self._store.is_visible(user_id, event_id):
            raise not_found("Event not found.")
        limit = min(max(request.int_arg("limit", 10), 0), MAX_LIMIT)
        event_filter = self._filter(request)
        after_event = await self._store.get_topological_token(event_id)
        # Backwards from just after the event serves it first: one more, then drop it.
        before, start = await self._page(room_id, user_id, after_event, "b", limit + 1, event_filter)
        before = [e for e in before if e["event_id"] != event_id][:limit]
        after, end = (
            (await self._page(room_id, user_id, after_event, "f", limit, event_filter)) if limit else ([], None)
        )
        state_ids = await state_for_user(self._store, room_id, user_id)
        fmt = functools.partial(format_for_client, self._store, requester=request.user)
        return {
            "event": (await fmt([event]))[0],
            "events_before": await fmt(before),
            "events_after": await fmt(after),
            "start": start or after_event,
            "end": end or after_event,
            "state": await fmt(await events_in_order(self._store, state_ids.values())),
        }
