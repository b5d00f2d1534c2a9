"""The client-server API's event format ("ClientEvent") of the store's served events.

The store serves events as their PDUs (``get_event``, ``sync``, ``paginate``,
``recent``): with the keys only servers use, and an ``unsigned`` object that
holds what the sending server put there (or, for a redacted event,
``redacted_because``, the redaction as a PDU). A client is given instead,
as the client-server specification's ClientEvent says:

* ``event_id``, ``type``, ``content``, ``sender``, ``origin_server_ts``,
  ``room_id``, ``state_key`` (state events only), and whatever other keys the
  PDU carries (``redacts`` of a redaction before room version 11), but not
  the federation's ``auth_events``, ``prev_events``, ``hashes``,
  ``signatures``, ``depth``, ``origin`` or (room versions 1 and 2)
  ``prev_state``;
* ``unsigned``, built here: ``age`` (``now_ms - origin_server_ts``),
  ``redacted_because`` (the redaction, itself in this format) when the event
  is redacted, and for a state event whose key had a state event in the state
  before it ``replaces_state`` (that event's ID) and ``prev_content`` (its
  content as served, pruned if it is redacted; left out for a redacted
  event, as a redaction drops it); of what the PDU's ``unsigned`` held only
  the stripped state an invite or knock carries (``invite_room_state``,
  ``knock_room_state``); and ``transaction_id`` when the caller names the
  device the events go to (``sent_by``) and that device sent the event with
  a ``ClientTxn``: the spec gives the sender's device its transaction ID, so
  a client matches the event to the one it is sending (its local echo).

``client_event`` is the pure step, given the replaced state event;
``format_client_events`` (``RoomStore.format_client_events``) finds those
for a batch: one transaction for the state before every state event of it,
each key looked up in its state group alone (and, with ``sent_by``, the
client transactions the requester's events were recorded with), then one
read of the replaced events through the event cache. Both answers are fixed
once an event is stored, so the store's ``EventReader`` keeps them (a purge
drops them): a batch it has seen before costs no transaction. Nothing given
is modified: the served events may be the cache's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from roomstore.pdu.redaction_algorithm import copy_json

__all__ = ["FEDERATION_KEYS", "KEPT_UNSIGNED_KEYS", "client_event", "format_client_events"]

#: Keys of a PDU that only servers use, dropped from the client format.
FEDERATION_KEYS = frozenset({"auth_events", "prev_events", "hashes", "signatures", "depth", "origin", "prev_state"})
#: Keys of a PDU's ``unsigned`` given to clients as they are (the stripped state of an invite or knock);
#: the rest of ``unsigned`` is computed (``age``, ``redacted_because``, ``prev_content``, ``replaces_state``).
KEPT_UNSIGNED_KEYS = frozenset({"invite_room_state", "knock_room_state"})


def client_event(event: Mapping[str, Any], now_ms: int, *, replaced_event: Mapping[str, Any] | None = None) -> dict:
    """``event`` (a served event dict) in the client format, its ``age`` at
    ``now_ms``. ``replaced_event``: the served state event of the same
    ``(type, state_key)`` in the state before it, if there is one (it gives
    ``replaces_state`` and ``prev_content``); only a state event uses it."""
    result = {key: copy_json(value) for key, value in event.items() if key not in FEDERATION_KEYS and key != "unsigned"}
    stored = event.get("unsigned")
    stored = stored if isinstance(stored, Mapping) else {}
    unsigned = {key: copy_json(value) for key, value in stored.items() if key in KEPT_UNSIGNED_KEYS}
    sent = event.get("origin_server_ts")
    if isinstance(sent, int) and not isinstance(sent, bool):
        unsigned["age"] = now_ms - sent
    redaction = stored.get("redacted_because")
    if isinstance(redaction, Mapping):
        unsigned["redacted_because"] = client_event(redaction, now_ms)
    if replaced_event is not None and "state_key" in event and "event_id" in replaced_event:
        unsigned["replaces_state"] = replaced_event["event_id"]
        if "redacted_because" not in unsigned and isinstance(replaced_event.get("content"), Mapping):
            unsigned["prev_content"] = copy_json(replaced_event["content"])
    result["unsigned"] = unsigned
    return result


async def format_client_events(
    reader: Any, db: Any, events: Sequence[Mapping[str, Any]], now_ms: int, sent_by: tuple[str, str] | None = None
) -> list[dict]:
    """``client_event`` of each of ``events``, in order, the replaced state
    event of each state event found in the state before it
    (``reader.replaced_state_txn``; an outlier, or an event the store does
    not hold, has none). ``reader``: the store's ``EventReader``; ``db``: its
    database. ``sent_by``: ``(user_id, device_id)`` of the device the events
    are for, whose transaction IDs are added."""
    wanted = [
        (event["event_id"], event["type"], event["state_key"])
        for event in events
        if isinstance(event.get("state_key"), str)
        and isinstance(event.get("type"), str)
        and isinstance(event.get("event_id"), str)
    ]
    mine = [] if sent_by is None else _sent_by(events, sent_by[0])
    # What a stored event replaced, and the client transaction it was sent
    # with, never change: the reader keeps the answers, so formatting a page
    # again (a room's old state events, one's own messages) costs no
    # transaction, and no walk of the state groups.
    known, uncached = reader.cached_replaced(event_id for event_id, _, _ in wanted)
    records, unrecorded = reader.cached_txn_records(mine)
    replaced = {event_id: found for event_id, found in known.items() if found is not None}
    uncached_ids = set(uncached)
    asked = [item for item in wanted if item[0] in uncached_ids]
    if asked or unrecorded:
        # One transaction for both lookups: each is a turn of the pool's queue.
        generation = reader.format_generation
        answers, fetched = await db.run_interaction("client_format_lookups", _lookups_txn, reader, asked, unrecorded)
        reader.cache_format_answers(generation, answers, fetched)
        replaced.update((event_id, found) for event_id, found in answers.items() if found is not None)
        records.update(fetched)
    txn_ids = {
        event_id: txn_id
        for event_id, found in records.items()
        for user_id, device_id, txn_id in found
        if sent_by == (user_id, device_id)
    }
    previous = await reader.get_events(sorted(set(replaced.values()))) if replaced else {}
    formatted = []
    for event in events:
        result = client_event(event, now_ms, replaced_event=previous.get(replaced.get(event.get("event_id"), "")))
        if event.get("event_id") in txn_ids:
            result["unsigned"]["transaction_id"] = txn_ids[event["event_id"]]
        formatted.append(result)
    return formatted


def _sent_by(events: Sequence[Mapping[str, Any]], user_id: str) -> list[str]:
    """The IDs of those of ``events`` that ``user_id`` sent."""
    return [
        event["event_id"]
        for event in events
        if event.get("sender") == user_id and isinstance(event.get("event_id"), str)
    ]


def _lookups_txn(txn: Any, reader: Any, wanted: list, mine: list[str]) -> tuple[dict[str, str | None], dict]:
    """The replaced state event of each of ``wanted``, and the client
    transactions ``mine`` (events the requester sent) were recorded with."""
    replaced = reader.replaced_state_txn(txn, wanted) if wanted else {}
    return replaced, reader.txn_records_txn(txn, mine) if mine else {}
