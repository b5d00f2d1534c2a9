"""Sending and redacting: ``PUT /rooms/{id}/send/{type}/{txnId}``,
``PUT /rooms/{id}/redact/{eventId}/{txnId}`` and ``GET /rooms/{id}/event/{id}``.

A transaction ID is the device's, for one endpoint: the same request path
(room, event type or redacted event, txn ID) from the same user and device
again returns the event the first request made, and makes none (the spec's
idempotency, scoped to the path as Synapse scopes it). The store's
``ClientTxn.txn_id`` is that path (``txn_ids.py``), so a client reusing a
txn ID in another room or for a redaction gets a new event."""

from __future__ import annotations

from roomstore.homeserver.client_events import format_for_client
from roomstore.homeserver.errors import not_found
from roomstore.homeserver.events import EventCreator
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.homeserver.txn_ids import redact_key, send_key
from roomstore.store import ClientTxn

__all__ = ["Sending"]


class Sending:
    def __init__(self, events: EventCreator):
        self._events = events

    def register_routes(self, router: Router) -> None:
        router.add("PUT", "/rooms/{roomId}/send/{eventType}/{txnId}", self.send)
        router.add("PUT", "/rooms/{roomId}/redact/{eventId}/{txnId}", self.redact)
        router.add("GET", "/rooms/{roomId}/event/{eventId}", self.get_event)

    async def send(self, request: ClientRequest) -> dict:
        user, room_id, event_type = request.user, request.params["roomId"], request.params["eventType"]
        txn = ClientTxn(user.user_id, user.device_id, send_key(room_id, event_type, request.params["txnId"]))
        event_id = await self._events.send(room_id, user.user_id, event_type, request.body, client_txn=txn)
        return {"event_id": event_id}

    async def redact(self, request: ClientRequest) -> dict:
        user, room_id, target = request.user, request.params["roomId"], request.params["eventId"]
        txn = ClientTxn(user.user_id, user.device_id, redact_key(room_id, target, request.params["txnId"]))
        content = {"reason": request.body["reason"]} if isinstance(request.body.get("reason"), str) else {}
        event_id = await self._events.send(
            room_id, user.user_id, "m.room.redaction", content, redacts=target, client_txn=txn
        )
        return {"event_id": event_id}

    async def get_event(self, request: ClientRequest) -> dict:
        store, event_id = self._events.store, request.params["eventId"]
        event = await store.get_event(event_id)
        if (
            event is None
            or event.get("room_id") != request.params["roomId"]
            or not await store.is_visible(request.user.user_id, event_id)
        ):
            raise not_found("Event not found.")
        [formatted] = await format_for_client(store, [event], request.user)
        return formatted
