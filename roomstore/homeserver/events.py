"""Building and storing the server's own events (every event a client asks
for: messages, state, memberships, redactions).

An event is built with ``roomstore.pdu.build_event`` on the room's forward
extremities (its ``prev_events``; its depth one more than theirs), citing
as ``auth_events`` the current state the spec's auth events selection names
(``roomstore.pdu.auth_rules.auth_types_for``), signed with the server's key,
and stored with ``persist_events``, which checks it against the room's
authorization rules: one that breaks them comes back rejected, and the client
gets 403 ``M_FORBIDDEN`` with the rule. Events of one room are built one at a
time (a lock per room), so this server never forks its own rooms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet import defer

from roomstore.homeserver.errors import MatrixError, forbidden, not_found
from roomstore.pdu import BuiltPdu, build_event
from roomstore.pdu.auth_rules import auth_types_for
from roomstore.pdu.room_versions import get_room_version
from roomstore.store import ClientTxn, EventToPersist

__all__ = ["EventCreator", "events_in_order", "local_auth_events"]

#: The most prev events an event cites (the newest extremities).
MAX_PREV_EVENTS = 10


async def events_in_order(store, event_ids) -> list[dict]:
    """The served events of ``event_ids``, in that order; those not served left out."""
    event_ids = list(event_ids)
    found = await store.get_events(event_ids)
    return [found[event_id] for event_id in event_ids if event_id in found]


def local_auth_events(
    room_version: str,
    state: Mapping[tuple[str, str], str],
    event_type: str,
    sender: str,
    state_key: str | None,
    content: Mapping[str, Any],
) -> list[str]:
    """The auth events of an event about to be built, from a state map."""
    wanted = auth_types_for(get_room_version(room_version), event_type, sender, state_key, content)
    return [state[key] for key in sorted(wanted) if key in state]


def _refuse_rejected(results) -> None:
    for result in results:
        if result.rejected_reason or result.soft_failed:
            raise forbidden(result.rejected_reason or "the event fails the room's current state")


class EventCreator:
    """Builds, signs and stores events for local users; see the module docstring."""

    def __init__(self, store, server_name: str, signing_key, clock):
        self.store = store
        self.server_name = server_name
        self.signing_key = signing_key
        self._clock = clock
        self._locks: dict[str, defer.DeferredLock] = {}

    def now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    async def room_version(self, room_id: str) -> str:
        version = await self.store.get_room_version(room_id)
        if version is None:
            raise not_found(f"Unknown room {room_id}")
        return version

    def build(
        self,
        room_version: str,
        room_id: str | None,
        sender: str,
        event_type: str,
        content: Mapping,
        state_key: str | None,
        prev_events: Sequence,
        auth_events: Sequence,
        depth: int,
        redacts: str | None = None,
    ) -> BuiltPdu:
        return build_event(
            room_version,
            room_id=room_id,
            sender=sender,
            type=event_type,
            content=content,
            state_key=state_key,
            prev_events=prev_events,
            auth_events=auth_events,
            depth=depth,
            origin_server_ts=self.now_ms(),
            signing_key=self.signing_key,
            redacts=redacts,
        )

    async def persist(self, built: Sequence[BuiltPdu], room_version: str) -> list:
        """Store events built here; 403 for the first one the rules reject."""
        results = await self.store.persist_events([EventToPersist(event.raw, room_version) for event in built])
        _refuse_rejected(results)
        return results

    async def _earlier_event(self, client_txn: ClientTxn | None) -> str | None:
        if client_txn is None:
            return None
        return await self.store.get_event_id_for_txn(client_txn.user_id, client_txn.device_id, client_txn.txn_id)

    async def send(
        self,
        room_id: str,
        sender: str,
        event_type: str,
        content: Mapping,
        state_key: str | None = None,
        redacts: str | None = None,
        client_txn: ClientTxn | None = None,
    ) -> str:
        """Build and store one event in ``room_id``; its event ID. With
        ``client_txn`` (user, device, txn ID) a retry returns the first event."""
        if not isinstance(content, dict):
            raise MatrixError(400, "M_BAD_JSON", "content must be a JSON object")
        version = await self.room_version(room_id)
        lock = self._locks.setdefault(room_id, defer.DeferredLock())
        await lock.acquire()
        try:
            wanted = auth_types_for(get_room_version(version), event_type, sender, state_key, content)
            # The three reads at once: on PostgreSQL each takes a connection of the pool.
            earlier, extremities, state = await defer.gatherResults(
                [
                    defer.ensureDeferred(self._earlier_event(client_txn)),
                    defer.ensureDeferred(self.store.get_forward_extremities(room_id)),
                    defer.ensureDeferred(self.store.get_current_state_ids(room_id, types=sorted(wanted))),
                ],
                consumeErrors=True,
            ).addErrback(lambda failure: failure.value.subFailure)
            if earlier is not None:
                return earlier  # a retry: the event the first request made
            prev_ids = extremities[-MAX_PREV_EVENTS:]
            prevs = (await self.store.get_events(prev_ids)).values()
            depth = max((event.get("depth", 0) for event in prevs), default=0) + 1
            built = self.build(
                version,
                room_id,
                sender,
                event_type,
                content,
                state_key,
                prev_ids,
                [state[key] for key in sorted(wanted) if key in state],
                depth,
                redacts,
            )
            # The store records the transaction with the event, in the transaction that stores it.
            [result] = await self.store.persist_events([EventToPersist(built.raw, version, client_txn=client_txn)])
            _refuse_rejected([result])
            return result.existing_txn_event_id or result.event_id
        finally:
            lock.release()
            if not lock.locked and not lock.waiting:
                self._locks.pop(room_id, None)
