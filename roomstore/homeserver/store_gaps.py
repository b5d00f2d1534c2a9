"""Adapters over the store's API for what it does not offer yet (issue 41
item 2): client transaction IDs, a user's pending invites, and a sync with a
limit, ``limited``, ``prev_batch`` and a state block per room. Each
stands in for the store's coming method of the same meaning and goes when
that lands; nothing else of the homeserver knows how they are made.
"""

from __future__ import annotations

import attrs

from roomstore.homeserver.tables import client_txns

__all__ = ["ClientTxn", "RoomTimeline", "event_id_for_txn", "invited_rooms", "record_client_txn", "sync"]


@attrs.frozen
class ClientTxn:
    """A client's transaction: the same (user, device, txn ID) is the same request."""

    user_id: str
    device_id: str
    txn_id: str


@attrs.frozen
class RoomTimeline:
    """A room's part of a sync: its timeline events (oldest first), whether
    older ones were left out, the token to page back from its first event,
    and the state before that event (or the room's, for an empty timeline)."""

    events: list
    limited: bool
    prev_batch: str | None
    state: list


async def event_id_for_txn(store, txn: ClientTxn) -> str | None:
    return await store.db.run_interaction("hs_get_client_txn", client_txns.get_client_txn_txn,
                                          txn.user_id, txn.device_id, txn.txn_id)


async def record_client_txn(store, txn: ClientTxn, event_id: str) -> None:
    await store.db.run_interaction("hs_add_client_txn", client_txns.add_client_txn_txn,
                                   txn.user_id, txn.device_id, txn.txn_id, event_id)


async def invited_rooms(store, user_id: str, since: str | None, result) -> dict[str, dict]:
    """Room ID -> invite event, for rooms whose newest membership of the user
    in the window is an invite. An initial sync's result lists no membership
    events, so then the user's whole history is read (a sync from the
    stream's start)."""
    if since is None:
        result = await store.sync(user_id, "s0")
        return {room_id: event for room_id, event in result.invited.items() if room_id not in result.joined}
    return result.invited


async def _token_before(store, room_id: str, user_id: str, event_id: str) -> str | None:
    """The pagination token just before an event (a page of one from just after it)."""
    page = await store.paginate(room_id, user_id, await store.get_topological_token(event_id), "b", 1)
    return page.next_token


async def _state_before(store, room_id: str, events: list) -> list:
    """The state before the first event (the room's now, with no events),
    less the events of the timeline."""
    if events:
        ids = await store.get_state_ids(events[0]["event_id"], before=True)
    else:
        ids = await store.get_current_state_ids(room_id)
    in_timeline = {event["event_id"] for event in events}
    found = await store.get_events([i for i in ids.values() if i not in in_timeline])
    return [found[i] for i in sorted(found)]


def _joined_in_window(result, room_id: str, user_id: str) -> bool:
    return any(e["room_id"] == room_id and (e.get("content") or {}).get("membership") == "join"
               for e in result.membership_events if e.get("state_key") == user_id)


async def sync(store, user_id: str, since: str | None, limit: int, full_state: bool = False):
    """``(SyncResult, {room_id: RoomTimeline})``: at most ``limit`` events a
    room; state where the client needs it (an initial or ``full_state`` sync,
    a limited timeline, a room joined since ``since``)."""
    if since is None:
        result = await store.sync(user_id, None, initial_limit=limit + 1)
    else:
        result = await store.sync(user_id, since)
    rooms = dict(result.rooms)
    if full_state and since is not None:
        rooms.update((room_id, []) for room_id in result.joined if room_id not in rooms)
    timelines = {}
    for room_id, events in rooms.items():
        limited = len(events) > limit
        kept = events[len(events) - limit:] if limit else []
        prev_batch = await _token_before(store, room_id, user_id, kept[0]["event_id"]) if kept else None
        wants_state = since is None or full_state or limited or _joined_in_window(result, room_id, user_id)
        state = await _state_before(store, room_id, kept) if wants_state else []
        timelines[room_id] = RoomTimeline(kept, limited, prev_batch, state)
    return result, timelines
