"""The face of ``RoomStore`` that replication uses instead of the store's
parts (docs/api.md, "Replication"): a stream's positions, pages of the
events, backfill and caches streams read for a follower, and the rows
another process wrote applied to this process's caches.

A base class of ``RoomStore``, apart because it is one concern: reading the
streams out and taking others' writes in, where the rest of the store reads
and writes events for its embedder. It uses the store's database, interners,
caches and stream views, which ``RoomStore.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from roomstore.events.stream_rows.pages import (
    backfill_page_txn,
    events_page_txn,
    invalidations_page_txn,
    stream_page_txn,
    stream_text_txn,
)
from roomstore.streams.view import GeneratorView

if TYPE_CHECKING:
    from roomstore.events.caches import StoreCaches
    from roomstore.storage.database import Database
    from roomstore.storage.interning import Interners


class ReplicationFace:
    """Stream pages out, others' writes in (see the module docstring)."""

    db: Database
    interners: Interners
    caches: StoreCaches
    _stream_views: dict[str, GeneratorView]

    def stream(self, name: str) -> GeneratorView:
        """The writers and positions of the built-in stream ``name`` (``KeyError`` for another name)."""
        return self._stream_views[name]

    async def read_events_stream(self, instance: str, from_token: int, upto: int, limit: int):
        """``(events, state, more)``: what ``instance`` wrote to the events
        stream in ``(from_token, upto]``, a page of at most ``limit`` events
        and the current-state changes they cover, in one snapshot
        (``roomstore.events.stream_rows.pages.events_page_txn`` says the fields)."""
        return await self.db.run_interaction(
            "replication_events", events_page_txn, self.interners, instance, from_token, upto, limit
        )

    async def read_events_stream_rows(
        self, instance: str, from_token: int, upto: int, limit: int, encoded: bool = False
    ):
        """``(rows, more)``: ``read_events_stream``'s page as the rows
        replication sends, ``(token, row)`` in token order, events and state
        changes together, each row as its JSON text with ``encoded``
        (``roomstore.events.stream_rows.rows`` says how)."""
        return await self.db.run_interaction(
            "replication_events",
            stream_page_txn,
            self.interners,
            live=True,
            instance=instance,
            from_token=from_token,
            upto=upto,
            limit=limit,
            encoded=encoded,
        )

    async def read_backfill_stream(self, instance: str, from_token: int, upto: int, limit: int):
        """``(events, more)``: a page of the backfill stream, ``(token,
        event_id, room_id, type, state_key, redacts)`` (positive tokens)."""
        return await self.db.run_interaction(
            "replication_backfill", backfill_page_txn, self.interners, instance, from_token, upto, limit
        )

    async def read_backfill_stream_rows(
        self, instance: str, from_token: int, upto: int, limit: int, encoded: bool = False
    ):
        """``(rows, more)``: ``read_backfill_stream``'s page as the rows
        replication sends, ``(token, row)``, as JSON text with ``encoded``."""
        return await self.db.run_interaction(
            "replication_backfill",
            stream_page_txn,
            self.interners,
            live=False,
            instance=instance,
            from_token=from_token,
            upto=upto,
            limit=limit,
            encoded=encoded,
        )

    async def read_stream_lines(self, stream: str, instance: str, from_token: int, upto: int, limit: int, prefix: str):
        """A page of the events (or ``backfill``) stream as the text of its
        RDATA lines, or None where SQLite wrote characters it leaves as they
        are: ``roomstore.events.stream_rows.rows.stream_text_txn`` says what."""
        return await self.db.run_interaction(
            "replication_lines",
            stream_text_txn,
            self.interners,
            live=stream == "events",
            instance=instance,
            from_token=from_token,
            upto=upto,
            limit=limit,
            prefix=prefix,
        )

    async def read_caches_stream(self, instance: str, from_token: int, upto: int, limit: int):
        """``(rows, more)``: a page of the caches stream, ``(stream_id,
        cache_name, keys or None, invalidation_ts)``, no stream ID split."""
        return await self.db.run_interaction(
            "replication_caches", invalidations_page_txn, instance, from_token, upto, limit
        )

    def replicated_event(
        self, token: int, room_id: str, event_type: str, state_key: str | None, redacts: str | None
    ) -> None:
        """Another process stored a live event at ``token`` of the events
        stream: drop what it changes from this process's caches."""
        self.caches.room_changed(room_id, token)
        if event_type == "m.room.member" and state_key is not None:
            self.caches.membership_changed(state_key, token)
        if redacts:
            self.caches.event_changed(redacts)

    def replicated_events(self, events: Sequence[tuple], state: Sequence[tuple] = ()) -> None:
        """``replicated_event`` for each of ``events`` (``(token, room_id,
        type, state_key, redacts)``) and ``replicated_state`` for each of
        ``state`` (``(token, type, state_key)``), both in token order, at
        once: the same caches dropped, each room's and member's change
        recorded once, at its newest token."""
        rooms = {room_id: token for token, room_id, _, _, _ in events}
        members = {
            key: token for token, _, event_type, key, _ in events if event_type == "m.room.member" and key is not None
        }
        for token, event_type, key in state:
            if event_type == "m.room.member" and members.get(key, -1) < token:
                members[key] = token
        self.caches.changes_replicated(rooms, members, [event[4] for event in events if event[4]])

    def replicated_changes(self, rooms: dict[str, int], members: dict[str, int], redacted: Sequence[str]) -> None:
        """What ``replicated_events`` records, given as each room's and
        member's newest token and the events redacted."""
        self.caches.changes_replicated(rooms, members, redacted)

    def replicated_state(self, token: int, event_type: str, state_key: str) -> None:
        """A current-state change at ``token`` (also one by state resolution,
        with no member event of the user): a member's membership moved."""
        if event_type == "m.room.member":
            self.caches.membership_changed(state_key, token)

    def replicated_state_reset(self, token: int, room_id: str) -> None:
        """Any current state of ``room_id`` may have changed at ``token``
        (Synapse's ``state-all``): anyone's membership there may have moved."""
        self.caches.room_changed(room_id, token)
        self.caches.all_memberships_changed()

    def replicated_backfill(self, redacts: str | None) -> None:
        """A backfilled event: it moves no current state, but an old
        redaction may redact an event this process cached."""
        if redacts:
            self.caches.event_changed(redacts)

    def replicated_invalidation(self, cache_name: str, keys: list | None) -> None:
        """Drop ``keys`` (None: everything) of a cache, as another process asked."""
        self.caches.apply_invalidation(cache_name, keys)
