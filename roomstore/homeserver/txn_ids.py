"""Client transaction IDs as the homeserver records them, and back.

A transaction is scoped to its request path, as Synapse scopes it: the key
recorded as ``ClientTxn.txn_id`` is ``send/{roomId}/{eventType}/{txnId}`` or
``redact/{roomId}/{redactedEventId}/{txnId}`` (``sending.py`` records them).
The spec gives the sending device its ``txnId`` again in the event's
``unsigned.transaction_id``, which clients match to their local echo:
:func:`client_txn_id` takes the key back to that ``txnId``, given the event
(whose room, type and ``redacts`` make the prefix, so a ``txnId`` holding a
``/`` comes back whole)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["client_txn_id", "redact_key", "send_key"]


def send_key(room_id: str, event_type: str, txn_id: str) -> str:
    return f"send/{room_id}/{event_type}/{txn_id}"


def redact_key(room_id: str, redacted_event_id: str, txn_id: str) -> str:
    return f"redact/{room_id}/{redacted_event_id}/{txn_id}"


def client_txn_id(event: Mapping[str, Any], key: str) -> str | None:
    """The client's ``txnId`` of the key recorded for ``event`` (a client
    format event), None when the key is not one this server makes for it."""
    room_id, event_type = event.get("room_id"), event.get("type")
    if event_type == "m.room.redaction":
        redacts = event.get("redacts") or (event.get("content") or {}).get("redacts")
        prefix = redact_key(str(room_id), str(redacts), "")
    else:
        prefix = send_key(str(room_id), str(event_type), "")
    return key[len(prefix) :] if key.startswith(prefix) and len(key) > len(prefix) else None
