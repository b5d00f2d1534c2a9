"""A worker that applies the store's streams to its own ``RoomStore``.

``StoreReplicationHandler`` feeds what arrives into the worker's store: it
drops the cache entries named by the rows, updates the change caches and then
advances the ID generators (``advance``), in that order, so a reader that
waited for a position (``wait_for_position``) never reads a cache entry older
than it. The rows are those :mod:`.store_streams` serves (its docstring says
what each stream's rows hold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zope.interface import implementer

from roomstore.replication.client import ReplicationClientHandler
from roomstore.replication.follower import StreamPositions
from roomstore.replication.handler_interface import IRowsHandler
from roomstore.replication.store_streams import STORE_STREAMS, store_stream_registry
from roomstore.store import RoomStore

__all__ = ["StoreReplicationHandler"]


@implementer(IRowsHandler)
class StoreReplicationHandler(ReplicationClientHandler):
    """Applies replicated rows to a worker's ``RoomStore``.

    For every token, in order: drop the cache entries the rows name, record
    the changes in the change caches, run the handlers registered with
    ``add_cache_handler`` (caches stream), advance the stream's ID generator
    to the token, then call ``on_applied(stream, instance, token, rows)`` if
    given (the ``follow`` command logs it; tests count rows). Applying a token
    twice (a replay after a reconnect) is harmless: every step is idempotent.
    The tokens of one read come through ``on_rdata_batch``: all their rows'
    cache entries first, then the position.

    The worker store must be opened as a reader of the writer's streams
    (``StoreConfig(stream_writers={"events": ["master"], ...})``); the rows
    themselves are read by the store from the shared database, so nothing
    here writes to it.
    """

    def __init__(self, store: RoomStore, on_applied: Callable[[str, str, int, list], Any] | None = None):
        super().__init__(store_stream_registry(store))
        self.store = store
        self.on_applied = on_applied
        self._cache_handlers: dict[str, list[Callable[[list | None], None]]] = {}

    def add_cache_handler(self, cache_name: str, handler: Callable[[list | None], None]) -> None:
        """Call ``handler(keys)`` for every invalidation of ``cache_name``
        (``keys`` None: the whole cache)."""
        self._cache_handlers.setdefault(cache_name, []).append(handler)

    def initial_positions(self) -> StreamPositions:
        """Where the worker's store stands now, per stream and writer: where
        a worker with no saved positions resumes from. The store has no
        cache entries older than these (it just opened), so nothing before
        them needs applying."""
        positions = StreamPositions()
        for name in STORE_STREAMS:
            for writer, token in self.store.stream(name).get_positions().items():
                positions.set(name, writer, token)
        return positions

    def on_rdata(self, stream_name: str, instance_name: str, token: int, rows: list[Any]) -> None:
        if stream_name == "events":
            self._apply_events(token, rows)
        elif stream_name == "backfill":
            for row in rows:
                self.store.replicated_backfill(row[4])
        elif stream_name == "caches":
            for row in rows:
                self._apply_invalidation(row[0], row[1])
        else:
            return
        # Last: a reader waiting for this position must find the caches clean.
        self._advance(stream_name, instance_name, token)
        if self.on_applied is not None:
            self.on_applied(stream_name, instance_name, token, rows)

    def on_rdata_batch(self, stream_name: str, instance_name: str, updates: list[tuple[int, list]]) -> None:
        """``on_rdata`` for many tokens at once (``updates``: ``(token,
        rows)``, in token order): every row's caches dropped, then the
        stream's generator advanced once, to the last token; with
        ``on_applied``, advanced to each token in turn and ``on_applied``
        called after each."""
        if stream_name == "events":
            events = [
                (token, data[1], data[2], data[3], data[4])
                for token, rows in updates
                for kind, data in rows
                if kind == "ev"
            ]
            others = [(token, kind, data) for token, rows in updates for kind, data in rows if kind != "ev"]
            self.store.replicated_events(
                events, [(token, data[1], data[2]) for token, kind, data in others if kind == "state"]
            )
            for token, kind, data in others:
                if kind == "state-all":
                    self.store.replicated_state_reset(token, data[0])
        elif stream_name == "backfill":
            backfill = self.store.replicated_backfill
            for _, rows in updates:
                for row in rows:
                    backfill(row[4])
        elif stream_name == "caches":
            for _, rows in updates:
                for row in rows:
                    self._apply_invalidation(row[0], row[1])
        else:
            return
        if self.on_applied is None:
            self._advance(stream_name, instance_name, updates[-1][0])
            return
        # Each token's position, then its on_applied: what on_applied sees
        # (the position, for one) is as after that token alone.
        for token, rows in updates:
            self._advance(stream_name, instance_name, token)
            self.on_applied(stream_name, instance_name, token, rows)

    def on_rdata_rows(self, stream_name: str, instance_name: str, tokens: list, rows: list) -> None:
        """``on_rdata_batch`` for a read's rows as they came: ``rows`` as
        decoded (arrays as lists) or read (tuples), ``tokens[i]`` the token
        of ``rows[i]`` (its line's), None for ``batch`` (the row is the next
        token's), the last one a token, in order. The same caches dropped, then the
        position moved once, to the last token, with no object per token;
        with ``on_applied``, through ``on_rdata_batch``."""
        if self.on_applied is not None or stream_name not in STORE_STREAMS:
            self.on_rdata_batch(stream_name, instance_name, _by_token(tokens, rows))
            return
        if stream_name == "events":
            if None in tokens:
                tokens = _filled(tokens)
            store = self.store
            rooms = {data[1]: token for token, (kind, data) in zip(tokens, rows, strict=True) if kind == "ev"}
            members = {
                data[3]: token
                for token, (kind, data) in zip(tokens, rows, strict=True)
                if kind == "ev" and data[2] == "m.room.member" and data[3] is not None
            }
            redacted = [data[4] for kind, data in rows if kind == "ev" and data[4]]
            others = [(token, kind, data) for token, (kind, data) in zip(tokens, rows, strict=True) if kind != "ev"]
            for token, kind, data in others:
                if kind == "state" and data[1] == "m.room.member" and members.get(data[2], -1) < token:
                    members[data[2]] = token
            store.replicated_changes(rooms, members, redacted)
            for token, kind, data in others:
                if kind == "state-all":
                    store.replicated_state_reset(token, data[0])
        elif stream_name == "backfill":
            backfill = self.store.replicated_backfill
            for row in rows:
                backfill(row[4])
        else:
            for row in rows:
                self._apply_invalidation(row[0], row[1])
        self._advance(stream_name, instance_name, tokens[-1])

    def on_position(self, stream_name: str, instance_name: str, prev_token: int, new_token: int) -> None:
        if stream_name in STORE_STREAMS:
            self._advance(stream_name, instance_name, new_token)

    def _advance(self, stream_name: str, instance_name: str, token: int) -> None:
        self.store.stream(stream_name).advance(instance_name, token)

    def _apply_events(self, token: int, rows: list) -> None:
        store = self.store
        for kind, data in rows:
            if kind == "ev":
                store.replicated_event(token, data[1], data[2], data[3], data[4])
            elif kind == "state":
                store.replicated_state(token, data[1], data[2])
            elif kind == "state-all":
                # Synapse's "too many state changes in this room".
                store.replicated_state_reset(token, data[0])

    def _apply_invalidation(self, cache_name: str, keys: list | None) -> None:
        self.store.replicated_invalidation(cache_name, keys)
        for handler in self._cache_handlers.get(cache_name, ()):
            handler(keys)


def _filled(tokens: list) -> list:
    """``tokens`` with each None (``batch``) replaced by the next token."""
    filled = list(tokens)
    for index in reversed([index for index, token in enumerate(tokens) if token is None]):
        filled[index] = filled[index + 1]
    return filled


def _by_token(tokens: list, rows: list) -> list[tuple[int, list]]:
    """``(token, rows)`` per token of ``on_rdata_rows``' arguments (a
    token's rows are together), rows as tuples."""
    updates: list[tuple[int, list]] = []
    for token, row in zip(_filled(tokens) if None in tokens else tokens, rows, strict=True):
        row = tuple(row) if type(row) is list else row
        if updates and updates[-1][0] == token:
            updates[-1][1].append(row)
        else:
            updates.append((token, [row]))
    return updates
