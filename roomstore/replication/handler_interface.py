"""What a worker supplies to receive replication: ``ReplicationClientHandler``.

Its own module so that both the client (which calls it) and the follower
(which applies updates through it) can import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from roomstore.replication.stream_interface import StreamRegistry

__all__ = ["ReplicationClientHandler"]


class ReplicationClientHandler:
    """What a worker supplies to receive replication. Subclass and override.

    ``streams`` holds the streams the worker understands and can read rows
    from (for the rows it missed); updates for any other stream are ignored.
    Each method may return an awaitable; updates to one stream are not
    delivered until the previous one's awaitable has finished.
    """

    def __init__(self, streams: StreamRegistry) -> None:
        self.streams = streams

    def on_rdata(self, stream_name: str, instance_name: str, token: int, rows: list[Any]) -> Awaitable[None] | None:
        """All rows of ``stream_name`` written by ``instance_name`` at ``token``
        (one call per token, never part of a batch)."""
        return None

    # Optional: ``on_rdata_batch(stream_name, instance_name, updates)``, with
    # ``updates`` a list of ``(token, rows)`` in increasing token order: what
    # ``on_rdata`` would be called with for each, in one call, for the tokens
    # that arrive together (a read of many RDATA lines). It applies them all
    # synchronously; if it raises, each token is applied again through
    # ``on_rdata`` (so applying must be idempotent). Defined by
    # ``StoreReplicationHandler``.

    def on_position(
        self, stream_name: str, instance_name: str, prev_token: int, new_token: int
    ) -> Awaitable[None] | None:
        """``instance_name``'s position in ``stream_name`` is now ``new_token``;
        any rows up to it have been delivered through ``on_rdata`` first."""
        return None

    def on_remote_server_up(self, server: str) -> None:
        """The main process says remote homeserver ``server`` may be back."""

    def on_lock_released(self, instance_name: str, lock_name: str, lock_key: str) -> None:
        """``instance_name`` released the lock ``(lock_name, lock_key)``."""

    def on_connected(self) -> None:
        """A connection to the expected server is up (e.g. resend USER_SYNC)."""
