"""roomstore: the storage subsystem of a Matrix homeserver.

Packages, one concern each (data flows one way: replication and compaction use
the store; the store never imports them):

- ``roomstore.storage``: database engines, the connection pool, schema migrations.
- ``roomstore.streams``: stream ID generators and stream change caches.
- ``roomstore.events``: event validation, room versions, redaction, persistence.
- ``roomstore.state``: state groups stored as deltas.
- ``roomstore.visibility``: history visibility computed at persist time.
- ``roomstore.replication``: the TCP replication protocol.
- ``roomstore.compaction``: offline state-group compaction (PySpark).
"""

__version__ = "0.1.0"
