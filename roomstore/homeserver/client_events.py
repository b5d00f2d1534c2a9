"""Events as this server hands them to clients: the store's client format
(``RoomStore.format_client_events``), plus a redaction's ``redacts`` at the
top level in room versions 11 and later too (where the PDU keeps it in
``content``), as clients written before version 11 read it there (matrix-nio
refuses a redaction without it) and as Synapse serves it; and for the
requesting device, ``unsigned.transaction_id`` on the events it sent, its
own ``txnId`` (``txn_ids.py``): clients match an event to their local echo
by it (matrix-js-sdk warns without it and guesses by event ID)."""

from __future__ import annotations

from collections.abc import Iterable

from roomstore.homeserver.txn_ids import client_txn_id

__all__ = ["format_for_client"]


async def format_for_client(store, events: Iterable[dict], requester=None) -> list[dict]:
    """``requester`` (an ``http.Requester``): the device the events go to."""
    sent_by = None if requester is None else (requester.user_id, requester.device_id)
    formatted = await store.format_client_events(list(events), sent_by=sent_by)
    for event in formatted:
        _redacts_on_top(event)
        key = event["unsigned"].pop("transaction_id", None)
        txn_id = None if key is None else client_txn_id(event, key)
        if txn_id is not None:
            event["unsigned"]["transaction_id"] = txn_id
        because = (event.get("unsigned") or {}).get("redacted_because")
        if isinstance(because, dict):
            _redacts_on_top(because)
    return formatted


def _redacts_on_top(event: dict) -> None:
    if event.get("type") == "m.room.redaction" and "redacts" not in event:
        redacts = (event.get("content") or {}).get("redacts")
        if isinstance(redacts, str):
            event["redacts"] = redacts
