"""Prometheus metrics for TCP replication.

Every metric is created exactly once, here, at import time, and registered with
the default ``prometheus_client`` registry. Protocols only ever call
``.labels(...)`` on these objects, so tests that build thousands of protocols
never hit "Duplicated timeseries" errors.

Label values are always drawn from a fixed set (``side`` is ``"server"`` or
``"client"``; ``command`` is a *known* command name), never from peer input:
a peer sending random command names must not be able to blow up the number of
time series. The one per-connection gauge is removed when its connection goes.
"""

from prometheus_client import Counter, Gauge

__all__ = [
    "child",
    "APPLIED_POSITION",
    "AUTH_FAILURES",
    "BYTES_RECEIVED",
    "BYTES_SENT",
    "COMMANDS_RECEIVED",
    "COMMANDS_SENT",
    "CONGESTION_DISCONNECTS",
    "CONNECTIONS",
    "INVALID_LINES",
    "PENDING_COMMANDS",
    "REDIS_CONNECTED",
    "REDIS_PUBLISHED",
    "REDIS_RDATA_BEFORE_POSITION",
    "REDIS_RECEIVED",
]

COMMANDS_RECEIVED = Counter(
    "roomstore_replication_commands_received",
    "Replication commands received and parsed, by command name",
    ["side", "command"],
)
COMMANDS_SENT = Counter(
    "roomstore_replication_commands_sent",
    "Replication commands written to the transport, by command name",
    ["side", "command"],
)
BYTES_RECEIVED = Counter(
    "roomstore_replication_received_bytes",
    "Bytes of replication lines received (including the delimiter)",
    ["side"],
)
BYTES_SENT = Counter(
    "roomstore_replication_sent_bytes",
    "Bytes of replication lines written to the transport (including the delimiter)",
    ["side"],
)
INVALID_LINES = Counter(
    "roomstore_replication_invalid_lines",
    "Received lines answered with ERROR, by reason class",
    ["side", "reason"],
)
PENDING_COMMANDS = Gauge(
    "roomstore_replication_pending_commands",
    "Commands buffered for a paused (congested) connection",
    ["connection"],
)
CONNECTIONS = Gauge(
    "roomstore_replication_connections",
    "Replication connections currently open",
    ["side"],
)
CONGESTION_DISCONNECTS = Counter(
    "roomstore_replication_congestion_disconnects",
    "Connections dropped because too many commands were pending",
)
AUTH_FAILURES = Counter(
    "roomstore_replication_auth_failures",
    "Server connections closed for failing the shared-secret check, by reason (wrong_secret, no_auth, timeout)",
    ["reason"],
)


_children: dict = {}


def child(metric, *labels: str):
    """``metric.labels(*labels)``, remembered: ``labels`` checks and hashes
    its arguments on every call, which costs more than the increment on the
    per-line paths. Only for metrics whose children are never removed."""
    key = (metric, labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


# Redis transport (roomstore.replication.redis).
REDIS_CONNECTED = Gauge(
    "roomstore_replication_redis_connected",
    "1 while the Redis connection of this role (publish, subscribe) is up",
    ["role"],
)
REDIS_PUBLISHED = Counter(
    "roomstore_replication_redis_published",
    "Commands published on Redis, by command name",
    ["command"],
)
REDIS_RECEIVED = Counter(
    "roomstore_replication_redis_received",
    "Commands received from Redis (own lines included), by command name ('invalid': unparsable)",
    ["command"],
)
REDIS_RDATA_BEFORE_POSITION = Counter(
    "roomstore_replication_redis_rdata_before_position",
    "RDATA dropped because its writer's POSITION had not yet been heard on this connection"
    " (the rows are filled from the database once it is)",
)
APPLIED_POSITION = Gauge(
    "roomstore_replication_applied_position",
    "Per stream and writer, the newest token this process has applied from replication",
    # "writer", not "instance": Prometheus sets "instance" on every scraped series (the target).
    ["stream", "writer"],
)
