"""Reading and setting a room's state: ``/rooms/{id}/state`` (all of it),
``/rooms/{id}/state/{type}/{key}`` (GET one event's content, PUT a new one),
``/rooms/{id}/members`` and ``/rooms/{id}/joined_members``.

A joined user reads the current state; a user who left or was banned the
state as it was when they did (the state after their membership event);
anyone else is refused (403)."""

from __future__ import annotations

from roomstore.homeserver.client_events import format_for_client
from roomstore.homeserver.errors import forbidden, not_found
from roomstore.homeserver.events import EventCreator, events_in_order
from roomstore.homeserver.http import ClientRequest, Router

__all__ = ["RoomState", "state_for_user"]


async def state_for_user(store, room_id: str, user_id: str) -> dict[tuple[str, str], str]:
    """The state ``user_id`` may see of ``room_id``; see the module docstring."""
    if await store.get_room_version(room_id) is None:
        raise not_found(f"Unknown room {room_id}")
    current = await store.get_current_state_ids(room_id)
    member_id = current.get(("m.room.member", user_id))
    if member_id is None:
        raise forbidden(f"{user_id} is not in room {room_id}")
    member = await store.get_event(member_id)
    membership = ((member or {}).get("content") or {}).get("membership")
    if membership == "join":
        return current
    if membership in ("leave", "ban"):
        return await store.get_state_ids(member_id)
    raise forbidden(f"{user_id} is not in room {room_id}")


class RoomState:
    def __init__(self, events: EventCreator):
        self._events = events
        self._store = events.store

    def register_routes(self, router: Router) -> None:
        router.add("GET", "/rooms/{roomId}/state", self.all_state)
        router.add("GET", "/rooms/{roomId}/state/{eventType}", self.get_state)
        router.add("GET", "/rooms/{roomId}/state/{eventType}/{stateKey}", self.get_state)
        router.add("PUT", "/rooms/{roomId}/state/{eventType}", self.put_state)
        router.add("PUT", "/rooms/{roomId}/state/{eventType}/{stateKey}", self.put_state)
        router.add("GET", "/rooms/{roomId}/members", self.members)
        router.add("GET", "/rooms/{roomId}/joined_members", self.joined_members)

    async def _state_events(self, request: ClientRequest, keys=None) -> list[dict]:
        ids = await state_for_user(self._store, request.params["roomId"], request.user.user_id)
        chosen = [event_id for key, event_id in sorted(ids.items()) if keys is None or keys(key)]
        return await events_in_order(self._store, chosen)

    async def all_state(self, request: ClientRequest) -> list:
        return await format_for_client(self._store, await self._state_events(request))

    async def get_state(self, request: ClientRequest) -> dict:
        wanted = (request.params["eventType"], request.params.get("stateKey", ""))
        events = await self._state_events(request, lambda key: key == wanted)
        if not events:
            raise not_found(f"Event not found: no {wanted[0]} state with key {wanted[1]!r}")
        if request.arg("format") == "event":
            [event] = await format_for_client(self._store, events)
            return event
        return events[0].get("content", {})

    async def put_state(self, request: ClientRequest) -> dict:
        event_id = await self._events.send(
            request.params["roomId"],
            request.user.user_id,
            request.params["eventType"],
            request.body,
            state_key=request.params.get("stateKey", ""),
        )
        return {"event_id": event_id}

    async def members(self, request: ClientRequest) -> dict:
        events = await self._state_events(request, lambda key: key[0] == "m.room.member")
        wanted, unwanted = request.arg("membership"), request.arg("not_membership")
        events = [
            e
            for e in events
            if (wanted is None or e["content"].get("membership") == wanted)
            and (unwanted is None or e["content"].get("membership") != unwanted)
        ]
        return {"chunk": await format_for_client(self._store, events)}

    async def joined_members(self, request: ClientRequest) -> dict:
        events = await self._state_events(request, lambda key: key[0] == "m.room.member")
        return {
            "joined": {
                e["state_key"]: {
                    "display_name": e["content"].get("displayname"),
                    "avatar_url": e["content"].get("avatar_url"),
                }
                for e in events
                if e["content"].get("membership") == "join"
            }
        }
