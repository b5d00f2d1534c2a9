"""roomstore: the storage subsystem of a Matrix homeserver.

An embedder imports what it uses from here, one place for every name
(docs/api.md): ``from roomstore import RoomStore, StoreConfig, EventToPersist``.
The names resolve on first use (PEP 562), not at package import: ``import
roomstore`` stays cheap (the store's modules bring Twisted and take about a
second), and the compaction job's executors import ``roomstore.state.deltas``
with none of the store's dependencies installed.

Packages, one concern each (data flows one way: the store never imports what
stands on it; docs/architecture.md draws the map):

- ``roomstore.storage``: database engines, the connection pool, schema migrations, the errors of the database.
- ``roomstore.streams``: stream ID generators and stream change caches.
- ``roomstore.pdu``: pure PDU code: room versions 1-12, parsing, hashes, signatures, redaction, the authorization
  rules, ``build_event``.
- ``roomstore.resolution``: state resolution v1, v2 and v2.1, pure.
- ``roomstore.events``: the event store's operations: persisting, reads, timelines, sync, pagination, purges.
- ``roomstore.state``: state groups stored as deltas.
- ``roomstore.visibility``: history visibility computed at persist time.
- ``roomstore.store``: ``RoomStore``, which composes the above.
- ``roomstore.replication``: replication to worker processes over TCP and Redis.
- ``roomstore.compaction``: offline state-group compaction (PySpark), of roomstore's or a Synapse's tables.
- ``roomstore.synapse_db``: reading a Synapse database (``import-synapse``, ``verify-synapse``).
- ``roomstore.homeserver``: a single-server Matrix homeserver written on this face.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

#: Each public name -> the module that defines it.
_HOME = {
    # The store and its configuration.
    "RoomStore": "roomstore.store",
    "StoreConfig": "roomstore.store_config",
    "EmbedderSchema": "roomstore.storage.embedder_schema",
    # Writing.
    "EventToPersist": "roomstore.events.write.batch",
    "ClientTxn": "roomstore.events.write.batch",
    "StateDelta": "roomstore.events.write.batch",
    "PersistedEvent": "roomstore.events.write.batch",
    "VerifyKeys": "roomstore.pdu.signatures",
    "load_verify_keys": "roomstore.pdu.signatures",
    "build_event": "roomstore.pdu.building",
    "BuiltPdu": "roomstore.pdu.building",
    # What reads return.
    "EventFlags": "roomstore.events.read.event_reader",
    "RoomMembership": "roomstore.events.read.user_rooms",
    "SyncResult": "roomstore.events.read.sync",
    "RoomTimeline": "roomstore.events.read.sync_state",
    "RecentResult": "roomstore.events.read.timeline",
    "PaginationResult": "roomstore.events.read.pagination",
    "PurgeResult": "roomstore.events.purge",
    # Errors.
    "EVENT_REFUSALS": "roomstore.events.write.persist",
    "NotFoundError": "roomstore.storage.errors",
    "StateGroupNotFound": "roomstore.state.groups",
    "InvalidEventError": "roomstore.pdu.json_decoding",
    "ContentHashMismatch": "roomstore.pdu.content_hash",
    "InvalidSignature": "roomstore.pdu.signatures",
    "UnknownRoomVersion": "roomstore.pdu.room_versions",
    "EventBuildError": "roomstore.pdu.building",
    "PrevEventsCycle": "roomstore.events.write.batch",
    "MissingStateError": "roomstore.events.write.batch_state",
    "InvalidToken": "roomstore.events.tokens",
    "WriterProcessLost": "roomstore.writer_process.parent",
    "DatabaseConfigError": "roomstore.storage.errors",
    "DatabaseUnavailableError": "roomstore.storage.errors",
    "StorageFullError": "roomstore.storage.errors",
    "SchemaError": "roomstore.storage.schema",
    "SchemaTooNewError": "roomstore.storage.schema",
    "WriterLockHeld": "roomstore.storage.writer_lock",
    "WriterLockLost": "roomstore.storage.writer_lock",
    "StreamConfigError": "roomstore.streams.id_generators",
}

__all__ = ["__version__", *_HOME]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'roomstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
