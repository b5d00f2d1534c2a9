"""What a worker supplies to receive replication: ``ReplicationClientHandler``.

Its own module so that both the client (which calls it) and the follower
(which applies updates through it) can import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from zope.interface import Attribute, Interface

from roomstore.replication.stream_interface import StreamRegistry

__all__ = ["IBatchHandler", "IRowsHandler", "ReplicationClientHandler"]


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

    # Optional: declare IBatchHandler or IRowsHandler (below) to be handed
    # many tokens at once; ``StoreReplicationHandler`` does.

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


class IBatchHandler(Interface):
    """A handler that applies many tokens in one call. Declare it with
    ``@implementer(IBatchHandler)``; the follower then uses it for the tokens
    that arrive together (a read of many RDATA lines, a page it fetched)."""

    streams = Attribute("The StreamRegistry the handler understands.")

    def on_rdata_batch(stream_name: str, instance_name: str, updates: list[tuple[int, list]]) -> None:
        """What ``on_rdata`` would be given for each ``(token, rows)`` of
        ``updates`` (increasing tokens), applied synchronously in one call.
        If it raises, each token is applied again through ``on_rdata``, so
        applying must be idempotent."""


class IRowsHandler(IBatchHandler):
    """A batch handler that also takes a read's rows as they came."""

    def on_rdata_rows(stream_name: str, instance_name: str, tokens: list, rows: list) -> None:
        """``on_rdata_batch`` for rows of one stream and writer, each with
        its token (None for ``batch``: the row belongs to the next token),
        tokens increasing and after the position. The same retry as there."""
