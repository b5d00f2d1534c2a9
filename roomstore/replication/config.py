"""The tunables both ends of a replication connection share."""

from __future__ import annotations

import attrs

from roomstore.replication.commands import MAX_LINE_LENGTH

__all__ = ["ReplicationConfig"]


def _positive(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen
class ReplicationConfig:
    """Tunables shared by both sides of a connection. Times are in seconds."""

    #: Send a PING when nothing else was sent for this long.
    ping_interval: float = attrs.field(default=5.0, validator=_positive)
    #: After the peer's first PING, close if it is silent for this long.
    ping_timeout: float = attrs.field(default=15.0, validator=_positive)
    #: Abort the transport if a close has not completed after this long.
    close_timeout: float = attrs.field(default=5.0, validator=_positive)
    #: Longest line accepted, in bytes without the delimiter.
    max_line_length: int = attrs.field(default=MAX_LINE_LENGTH, validator=_positive)
    #: Commands buffered for a paused connection before it is dropped; on the
    #: client, stream commands queued behind a slow fetch before it gives up.
    max_pending_commands: int = attrs.field(default=10_000, validator=_positive)
    #: Rows per ``get_updates`` call when catching a connection up (and when
    #: a client fetches rows it missed). Pages of 100 rows cost a worker
    #: catching up from 0 more in database round trips than in rows.
    page_size: int = attrs.field(default=1000, validator=_positive)
    #: Pages a server reads ahead per stream and writer while earlier ones
    #: are sent (reads in flight at once, so memory per connection is about
    #: this many pages more).
    read_ahead: int = attrs.field(default=2, validator=_positive)
    #: Most ``batch`` rows a client buffers while waiting for the token line.
    max_batch_rows: int = attrs.field(default=10_000, validator=_positive)
    #: Bytes a client takes from its socket per read (a read's lines are
    #: parsed and applied at once): 256 KiB, a page or two of RDATA.
    read_size: int = attrs.field(default=256 * 1024, validator=_positive)
    #: Most bytes given to the socket per send: a page in one.
    write_size: int = attrs.field(default=1024 * 1024, validator=_positive)
