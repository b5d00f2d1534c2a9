"""``GET /sync``: initial and incremental, long-polled.

An incremental sync (``since``) that finds nothing waits up to ``timeout``
ms for the :class:`Notifier` to report a stored event, then looks again. The
rooms come in the spec's three sections: ``join`` (timeline, ``limited``,
``prev_batch``, the state before the timeline where the client needs it),
``invite`` (the invite and the room's stripped state) and ``leave`` (the
timeline up to the user's leave, ban or kick). The filter's
``room.timeline`` (``limit``, ``types``, ...), ``room.rooms`` and
``room.include_leave`` apply; the sections this server keeps nothing for
(account data, presence, to-device, device lists) are empty.
"""

from __future__ import annotations

from roomstore.homeserver.client_events import format_for_client
from roomstore.homeserver.events import events_in_order
from roomstore.homeserver.filters import Filters, SyncFilter
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.homeserver.notifier import Notifier

__all__ = ["SyncHandler"]

#: The state an invitee sees of the room before joining (the spec's recommendation).
STRIPPED_STATE_TYPES = (
    "m.room.create",
    "m.room.join_rules",
    "m.room.name",
    "m.room.canonical_alias",
    "m.room.avatar",
    "m.room.encryption",
    "m.room.topic",
)
MAX_TIMEOUT_MS = 5 * 60 * 1000


def _empty_body(next_batch: str) -> dict:
    return {
        "next_batch": next_batch,
        "rooms": {"join": {}, "invite": {}, "leave": {}, "knock": {}},
        "account_data": {"events": []},
        "presence": {"events": []},
        "to_device": {"events": []},
        "device_lists": {"changed": [], "left": []},
        "device_one_time_keys_count": {},
    }


class SyncHandler:
    def __init__(self, store, filters: Filters, notifier: Notifier, clock):
        self._store = store
        self._filters = filters
        self._notifier = notifier
        self._clock = clock

    def register_routes(self, router: Router) -> None:
        router.add("GET", "/sync", self.sync)

    async def sync(self, request: ClientRequest) -> dict:
        user_id = request.user.user_id
        since = request.arg("since")
        full_state = request.arg("full_state") == "true"
        timeout_s = min(max(request.int_arg("timeout", 0), 0), MAX_TIMEOUT_MS) / 1000
        sync_filter = await self._filters.sync_filter(user_id, request.arg("filter"))
        deadline = self._clock.seconds() + timeout_s
        gone: list[object] = []
        request.http.notifyFinish().addBoth(gone.append)  # the client gave up: stop waiting for it
        while True:
            seen = self._notifier.position
            body, joined = await self._sync_once(request.user, since, sync_filter, full_state)
            rooms = body["rooms"]
            empty = not (rooms["join"] or rooms["leave"] or rooms["invite"])
            remaining = deadline - self._clock.seconds()
            if not empty or since is None or full_state or remaining <= 0 or gone:
                return body
            # Only a batch in one of the user's rooms, or changing their membership, wakes it.
            await self._notifier.wait_for_change(seen, remaining, user_id, joined)
            since = body["next_batch"]

    async def _sync_once(
        self, requester, since: str | None, sync_filter: SyncFilter, full_state: bool
    ) -> tuple[dict, frozenset[str]]:
        """The body, and the rooms the user is joined to."""
        store, user_id = self._store, requester.user_id
        limit = sync_filter.timeline_limit
        result = await store.sync(user_id, since, initial_limit=limit, limit=limit, full_state=full_state)
        body = _empty_body(result.next_token)
        rooms = body["rooms"]
        left = result.left
        shown = [
            (room_id, timeline)
            for room_id, timeline in sorted(result.timelines.items())
            if sync_filter.rooms.allows_room(room_id)
            and (room_id in result.joined or (room_id in left and (since is not None or sync_filter.include_leave)))
        ]
        for (room_id, _), section in zip(shown, await self._room_sections(shown, sync_filter, requester), strict=True):
            if room_id in result.joined:
                section.update(
                    ephemeral={"events": []},
                    summary={},
                    unread_notifications={"highlight_count": 0, "notification_count": 0},
                )
                rooms["join"][room_id] = section
            else:
                rooms["leave"][room_id] = section
        invited = await self._invites(user_id, since, result)
        for room_id, invite in sorted(invited.items()):
            if room_id not in result.joined and sync_filter.rooms.allows_room(room_id):
                rooms["invite"][room_id] = {"invite_state": {"events": await self._stripped_state(room_id, invite)}}
        return body, result.joined

    async def _invites(self, user_id: str, since: str | None, result) -> dict[str, dict]:
        """Room ID -> invite: every pending one on an initial sync, else those of the window."""
        if since is not None:
            return result.invited
        pending = await self._store.get_rooms_for_user_by_membership(user_id, ["invite"])
        invites = await events_in_order(self._store, [membership.event_id for membership in pending])
        return {event["room_id"]: event for event in invites}

    async def _room_sections(self, shown: list, sync_filter: SyncFilter, requester) -> list[dict]:
        """Each room's timeline and state, every room's events formatted in
        two calls (the timelines', the states'), not two a room: an initial
        sync of many rooms is then two turns of the database pool, not one
        per room."""
        timelines = [sync_filter.timeline.apply(timeline.events) for _, timeline in shown]
        formatted_events = await format_for_client(self._store, [e for events in timelines for e in events], requester)
        formatted_state = await format_for_client(self._store, [e for _, t in shown for e in t.state])
        sections = []
        for (_, timeline), events in zip(shown, timelines, strict=True):
            formatted = {"events": formatted_events[: len(events)], "limited": timeline.limited}
            del formatted_events[: len(events)]
            if timeline.prev_batch is not None:
                formatted["prev_batch"] = timeline.prev_batch
            state = formatted_state[: len(timeline.state)]
            del formatted_state[: len(timeline.state)]
            sections.append({"timeline": formatted, "state": {"events": state}, "account_data": {"events": []}})
        return sections

    async def _stripped_state(self, room_id: str, invite: dict) -> list[dict]:
        ids = await self._store.get_current_state_ids(room_id, types=[(t, "") for t in STRIPPED_STATE_TYPES])
        events = await events_in_order(self._store, ids.values())
        stripped = [{key: event[key] for key in ("type", "state_key", "content", "sender")} for event in events]
        stripped.append({key: invite[key] for key in ("type", "state_key", "content", "sender")})
        return stripped
