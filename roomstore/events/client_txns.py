"""Client transaction IDs: recording which event a client's ``PUT
/rooms/{roomId}/send/{eventType}/{txnId}`` made, so a retry finds it.

``record_client_txns`` runs in the persister's batch transaction, after the
batch's event rows: each new, accepted event given with a
``EventToPersist.client_txn`` is recorded as that transaction's event
(``roomstore.events.tables.client_txns``), in the transaction that stores
the event, so the record exists exactly when the event does.

A transaction ID names one event, the first recorded. An event given with a
transaction already recorded for another event (a retry the homeserver did
not catch with ``RoomStore.get_event_id_for_txn``, or two racing requests;
two events of one batch too: the first wins) is still stored, but the record
is left as it was and the event's result carries the recorded event's ID in
``PersistedEvent.existing_txn_event_id``: the homeserver answers the request
with that ID. A rejected event records nothing (there is nothing to serve a
retry), nor does an event stored before (``already_persisted``), whose write
is a no-op.

Who calls it: ``roomstore.events.persist``'s batch writer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from roomstore.events.batch import PersistedEvent, PreparedEvent
from roomstore.events.tables.client_txns import TxnKey, event_nids_of_txns_txn, queue_txns

__all__ = ["record_client_txns"]


def record_client_txns(
    writer: Any,
    new_events: Sequence[PreparedEvent],
    room_nids: Mapping[str, int],
    results: dict[str, PersistedEvent],
) -> None:
    """Record the batch's client transactions (see the module docstring);
    ``results`` of events whose transaction names another event get
    ``existing_txn_event_id``. ``writer``: the batch writer (its
    transaction, interned IDs and clock). Two statements, only for a batch
    with client transactions: the insert, then the read of who owns each."""
    sent = [
        (ev, client_txn)
        for ev in new_events
        if (client_txn := ev.client_txn) is not None and not results[ev.event_id].rejected_reason
    ]
    if not sent:
        return
    writer.intern_users({client_txn.user_id for _, client_txn in sent})
    keys: dict[str, TxnKey] = {
        ev.event_id: (writer.user_nids[client_txn.user_id], client_txn.device_id, client_txn.txn_id)
        for ev, client_txn in sent
    }
    rows: dict[TxnKey, tuple] = {}
    for ev, _ in sent:
        key = keys[ev.event_id]
        rows.setdefault(key, (*key, writer.event_nids[ev.event_id], room_nids[ev.pdu.room_id], writer.now_ms))
    # A key recorded before (or by a racing writer) keeps its event.
    queue_txns(writer.txn, list(rows.values()))
    owners = event_nids_of_txns_txn(writer.txn, rows)
    others = {
        event_id: owners[key]
        for event_id, key in keys.items()
        if owners.get(key, writer.event_nids[event_id]) != writer.event_nids[event_id]
    }
    if not others:
        return
    names = writer.p.interners.events.resolve(writer.txn, set(others.values()))
    for event_id, owner in others.items():
        results[event_id] = attrs.evolve(results[event_id], existing_txn_event_id=names[owner])
