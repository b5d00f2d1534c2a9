"""Events as this server hands them to clients: the store's client format
(``RoomStore.format_client_events``), plus a redaction's ``redacts`` at the
top level in room versions 11 and later too (where the PDU keeps it in
``content``), as clients written before version 11 read it there (matrix-nio
refuses a redaction without it) and as Synapse serves it."""

from __future__ import annotations

from typing import Iterable

__all__ = ["format_for_client"]


async def format_for_client(store, events: Iterable[dict]) -> list[dict]:
    formatted = await store.format_client_events(list(events))
    for event in formatted:
        _redacts_on_top(event)
        because = (event.get("unsigned") or {}).get("redacted_because")
        if isinstance(because, dict):
            _redacts_on_top(because)
    return formatted


def _redacts_on_top(event: dict) -> None:
    if event.get("type") == "m.room.redaction" and "redacts" not in event:
        redacts = (event.get("content") or {}).get("redacts")
        if isinstance(redacts, str):
            event["redacts"] = redacts
