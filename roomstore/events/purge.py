"""Purges: a room's history before a point, or a whole room.

``Purger.purge_history`` deletes the events of a room at or before a
position in its topological order, keeping what the room still needs, as
Synapse's ``purge_history`` does: every state event (the current state, the
state and auth events of what remains, all of them), the forward
extremities (new events build on them), a redaction whose target stays
(deleting it would show the target whole again), and, unless
``delete_local_events``, the events of the store's own server's users
(``StoreConfig.server_name``; with none, no event is local). The kept
events before the position, forward extremities aside, become outliers:
out of the timelines, with no state of their own, so pagination stops at
the purge point, and the prev events the remaining timeline names but no
longer has become backward extremities, where backfill would go on. State
groups no remaining event is before or after, nor has in its chain of
predecessors, are deleted; so the state at every remaining timeline event
reads as it did. The IDs of the deleted events go from ``event_ids`` where
no remaining row names them. Visibility snapshots and membership rows stay:
the state events they describe stay too.

``Purger.purge_room`` deletes every row of a room in the store's tables,
its ``rooms`` row and the event IDs that no other row names included.

Each purge is one transaction, which first takes the room's row (a write to
the room waits, or fails and is retried) and asks the compaction job's lock
(it waits while the job runs, as ``RoomStore.delete_state_groups`` does).
It writes one row of the caches stream (``HISTORY_PURGED`` or
``ROOM_PURGED``) so every process drops its caches, and the writer's stream
positions, so that a restart never recovers a position lower than the rows
deleted had reached. A purge that finds nothing to do writes nothing: a
re-run is harmless.

Who calls it: ``RoomStore.purge_history`` and ``purge_room``. What it may
call: the tables' owners, the state groups, the streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from roomstore.events.caches import HISTORY_PURGED, ROOM_PURGED, StoreCaches, write_cache_invalidations
from roomstore.events.read.pagination import newest_key_at_txn
from roomstore.events.read_positions import ReadPositions
from roomstore.events.tables import event_graph, room_state
from roomstore.events.tables import events as event_tables
from roomstore.events.tables.client_txns import delete_event_txns_txn, delete_room_txns_txn
from roomstore.events.tokens import TopologicalToken
from roomstore.state.group_tables import room_group_links_txn
from roomstore.state.groups import (
    StateGroupStore,
    compaction_lock_txn,
    delete_groups_txn,
    run_when_unlocked,
)
from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    Interners,
    current_state_group_txn,
    delete_event_ids_txn,
    delete_room_txn,
    lock_room_txn,
)
from roomstore.streams.id_generators import persist_positions_txn
from roomstore.streams.reservations import reserve_in_transaction
from roomstore.visibility.memberships import delete_room_memberships_txn
from roomstore.visibility.snapshots import delete_room_visibility_txn

__all__ = ["PurgeResult", "Purger"]


@attrs.frozen
class PurgeResult:
    """What a purge removed.

    ``rows_deleted``: table -> rows deleted (tables it deleted nothing from
    are absent); ``state_groups_deleted``: the state groups among them;
    ``events_made_outliers``: events before the point that stayed as
    outliers (``purge_history``).
    """

    room_id: str
    rows_deleted: dict[str, int] = attrs.field(factory=dict)
    state_groups_deleted: int = 0
    events_made_outliers: int = 0

    @property
    def changed(self) -> bool:
        """Whether the purge changed anything (a re-run finds nothing)."""
        return bool(self.rows_deleted) or self.events_made_outliers > 0

    def as_json(self) -> dict:
        """The result as one JSON object (the command line prints it)."""
        return {
            "room_id": self.room_id,
            "rows_deleted": dict(sorted(self.rows_deleted.items())),
            "state_groups_deleted": self.state_groups_deleted,
            "events_made_outliers": self.events_made_outliers,
        }


def referenced_nids_txn(txn: Transaction, nids: Iterable[int]) -> set[int]:
    """Those of ``nids`` that a stored row of the event tables names: an
    event, a prev or auth event of one, a redaction's target."""
    return event_tables.referenced_nids_txn(txn, nids) | event_graph.referenced_nids_txn(txn, nids)


@attrs.frozen
class Purger:
    """Runs purges; see the module docstring.

    ``streams``: the events, backfill and caches stream generators (the
    purge persists the first two's positions and writes to the third).
    ``server_name``: the store's own server, whose users' events
    ``purge_history`` keeps by default (None: no event is local).
    """

    db: Any
    interners: Interners
    state_groups: StateGroupStore
    positions: ReadPositions
    caches: StoreCaches
    streams: tuple
    instance_name: str
    server_name: str | None
    clock: Any
    now_ms: Callable[[], int]

    async def purge_history(
        self,
        room_id: str,
        before_token: str,
        delete_local_events: bool = False,
        lock_timeout_s: float = 600.0,
        poll_interval_s: float = 1.0,
    ) -> PurgeResult:
        """Delete the room's events at or before ``before_token``: a
        ``t<topo>-<stream>`` token (``get_topological_token(e)`` is the
        position just after ``e``: ``e`` goes too) or a stream token (the
        position just after the newest event at or before it, in
        topological order, as ``paginate`` reads it). ``InvalidToken`` for
        a bad token or one ahead of the stream."""
        if isinstance(before_token, str) and before_token.startswith("t"):
            target: tuple = ("t", TopologicalToken.parse(before_token).as_tuple())
        else:
            token = self.positions.parse_stream_token(before_token)
            await self.positions.ensure_instances(token)
            await self.positions.reach(token)
            target = ("s", self.positions.per_writer(token))
        return await self._run(
            "purge_history", self._history_txn, room_id, (target, delete_local_events), lock_timeout_s, poll_interval_s
        )

    async def purge_room(
        self, room_id: str, lock_timeout_s: float = 600.0, poll_interval_s: float = 1.0
    ) -> PurgeResult:
        """Delete every row of the room (the module docstring says which)."""
        return await self._run("purge_room", self._room_txn, room_id, (), lock_timeout_s, poll_interval_s)

    async def _run(self, name: str, body_txn, room_id: str, args: tuple, timeout_s: float, poll_s: float):
        """``body_txn`` in one transaction with a caches-stream ID at hand,
        again while the compaction job holds its lock; this process's caches
        dropped before the ID completes."""
        cache_name = ROOM_PURGED if name == "purge_room" else HISTORY_PURGED

        async def attempt(now: int) -> tuple:
            async with reserve_in_transaction(
                [self.streams[2]], name, self._in_transaction, body_txn, room_id, args, cache_name, timeout_s, now
            ) as (outcome, _):
                if outcome[0] == "done" and outcome[1].changed:
                    self.caches.purged([room_id], whole_room=cache_name == ROOM_PURGED)
            return outcome

        return await run_when_unlocked(
            attempt, timeout_s, poll_s, self.clock, self.now_ms, f"state groups of {room_id}"
        )

    def _in_transaction(
        self,
        txn: Transaction,
        take,
        body_txn,
        room_id: str,
        args: tuple,
        cache_name: str,
        timeout_s: float,
        now_ms: int,
    ) -> tuple:
        """The room's row taken, the compaction lock asked, the purge, and
        (if it deleted anything) its caches-stream row and stream positions."""
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None or not lock_room_txn(txn, room_nid):
            return ("done", PurgeResult(room_id), None)
        lock = compaction_lock_txn(txn, timeout_s, now_ms)
        if lock[0] == "locked":
            return lock
        result = body_txn(txn, room_id, room_nid, *args)
        if result.changed:
            ((stream_id,),) = take([1])
            write_cache_invalidations(txn, stream_id, self.instance_name, [(cache_name, [room_id])], now_ms)
            persist_positions_txn(
                txn,
                [
                    (gen, gen.get_current_token_for_writer(self.instance_name))
                    for gen in self.streams[:2]
                    if gen.is_writer
                ],
            )
        return ("done", result, lock[1])

    # ------------------------------------------------------------------ history

    def _history_txn(
        self, txn: Transaction, room_id: str, room_nid: int, target: tuple, delete_local_events: bool
    ) -> PurgeResult:
        kind, where = target
        key = where if kind == "t" else newest_key_at_txn(txn, room_nid, where)
        candidates = [] if key is None else event_tables.events_upto_txn(txn, room_nid, tuple(key))
        if not candidates:
            return PurgeResult(room_id)
        forward = set(room_state.extremity_nids_txn(txn, room_nid, "forward"))
        local = set() if delete_local_events else self._local_senders(txn, {c.sender_nid for c in candidates})
        kept = {c.event_nid for c in candidates if c.is_state or c.sender_nid in local or c.event_nid in forward}
        doomed = {c.event_nid for c in candidates} - kept
        kept |= self._needed_redactions(txn, room_nid, doomed)
        doomed -= kept
        counts: dict[str, int] = {}
        event_tables.delete_events_txn(txn, sorted(doomed), counts)
        event_graph.delete_edges_txn(txn, sorted(doomed), counts)
        counts["client_txn_ids"] = delete_event_txns_txn(txn, sorted(doomed))
        outliers = [
            c.event_nid for c in candidates if c.event_nid in kept and not c.outlier and c.event_nid not in forward
        ]
        made = event_tables.make_outliers_txn(txn, outliers)
        # Backward extremities: what the remaining timeline names but does not hold.
        backward = event_graph.room_prevs_txn(txn, room_nid) - event_tables.graph_nids_txn(txn, room_nid)
        counts["backward_extremities"] = room_state.replace_backward_extremities_txn(txn, room_nid, backward)
        # The deleted events' IDs that nothing names any more (the new
        # backward extremities and redacted targets are named still).
        counts["event_ids"] = delete_event_ids_txn(txn, sorted(doomed - referenced_nids_txn(txn, doomed)))
        groups = self._delete_unused_groups(txn, room_nid, counts)
        counts = {table: n for table, n in counts.items() if n}
        return PurgeResult(room_id, counts, groups, made)

    def _local_senders(self, txn: Transaction, sender_nids: set[int]) -> set[int]:
        """The senders among ``sender_nids`` on ``server_name``."""
        if self.server_name is None:
            return set()
        return {
            nid
            for nid, user_id in self.interners.users.resolve(txn, sender_nids).items()
            if user_id.partition(":")[2] == self.server_name
        }

    def _needed_redactions(self, txn: Transaction, room_nid: int, doomed: set[int]) -> set[int]:
        """The redactions among ``doomed`` whose target, in the room, stays."""
        targets = event_tables.redaction_targets_txn(txn, doomed)
        stored = event_tables.stored_events_txn(txn, set(targets.values()) - doomed)
        return {
            redaction
            for redaction, target in targets.items()
            if target not in doomed and target in stored and stored[target].room_nid == room_nid
        }

    def _delete_unused_groups(self, txn: Transaction, room_nid: int, counts: dict[str, int]) -> int:
        """Delete the room's state groups that neither a stored event nor the
        current state uses; how many. A remaining group stored as a delta on
        one of them is rewritten as a snapshot of its state first (as
        Synapse does), so an old chain goes whole and no state changes."""
        in_use = event_tables.groups_in_use_txn(txn, room_nid)
        current = current_state_group_txn(txn, room_nid)
        if current is not None:
            in_use.add(current)
        unused = sorted(set(room_group_links_txn(txn, room_nid)) - in_use)
        return delete_groups_txn(txn, self.state_groups, unused, counts) if unused else 0

    # ------------------------------------------------------------------ room

    def _room_txn(self, txn: Transaction, room_id: str, room_nid: int) -> PurgeResult:
        nids = event_tables.room_event_nids_txn(txn, room_nid)
        # Every ID the room's rows name: its events, their prev and auth
        # events, its backward extremities; deleted where nothing else names them.
        named = set(nids) | event_graph.edge_targets_txn(txn, nids)
        named |= set(room_state.extremity_nids_txn(txn, room_nid, "backward"))
        counts: dict[str, int] = {}
        groups = sorted(room_group_links_txn(txn, room_nid))
        deleted_groups = delete_groups_txn(txn, self.state_groups, groups, counts) if groups else 0
        event_tables.delete_events_txn(txn, nids, counts)
        event_graph.delete_edges_txn(txn, nids, counts)
        room_state.delete_room_txn(txn, room_nid, counts)
        counts["room_memberships"] = delete_room_memberships_txn(txn, room_nid)
        counts["client_txn_ids"] = delete_room_txns_txn(txn, [room_nid])
        delete_room_visibility_txn(txn, room_nid, counts)
        counts["event_ids"] = delete_event_ids_txn(txn, sorted(named - referenced_nids_txn(txn, named)))
        counts["rooms"] = delete_room_txn(txn, room_nid)
        return PurgeResult(room_id, {table: n for table, n in counts.items() if n}, deleted_groups)
