"""Federation reads: backfill and missing events, walks over the prev-event graph.

These are server to server: no user visibility filter. They walk the
prev-event graph of stored, non-outlier events of the room only (an outlier's
prev events are not part of the room graph we hold); rejected events are
walked through, so their ancestors are reached, but never returned (as
Synapse does for backfill). Events come back as ``EventReader.events_txn``
returns them (parsed, pruned when redacted in the same room).

Who calls it: ``RoomStore.backfill`` and ``RoomStore.get_missing_events``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import attrs

from roomstore.events.read.event_reader import EventReader
from roomstore.events.tables.event_graph import prev_facts_txn
from roomstore.events.tables.events import graph_facts_txn
from roomstore.storage.database import Database, Transaction
from roomstore.storage.interning import Interners, chunks

__all__ = ["FederationReader"]


@attrs.frozen
class FederationReader:
    """Backfill and missing events; see the module docstring.

    Its fields are its collaborators: the database, the interners (room and
    event nids) and the event reader (the served form of the events found).
    """

    db: Database
    interners: Interners
    events: EventReader

    async def backfill(self, room_id: str, event_ids: Sequence[str], limit: int) -> list[dict]:
        """Up to ``limit`` events of ``room_id`` from ``event_ids`` (inclusive)
        backwards, in topological order (oldest first).

        Breadth first over prev events with a priority queue on depth, the
        deepest first (Synapse's ``get_backfill_events``): since an event is
        deeper than its prev events, these are the ``limit`` deepest events
        at or before the given ones. Given events not in the room, unknown or
        outliers are ignored; rejected events are walked through but not
        returned (and do not count towards ``limit``).
        """
        if limit <= 0 or not event_ids:
            return []
        return await self.db.run_interaction("backfill", self._backfill_txn, room_id, list(event_ids), limit)

    def _backfill_txn(self, txn: Transaction, room_id: str, event_ids: list[str], limit: int) -> list[dict]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        walk = _GraphWalk(txn, room_nid)
        for nid, facts in walk.graph_events(self.interners.events.lookup(txn, event_ids).values()).items():
            walk.push(nid, facts)
        result: list[int] = []
        while walk.heap and len(result) < limit:
            nid = walk.pop()
            if not walk.facts[nid].rejected:
                result.append(nid)
            for prev in walk.prevs_of(nid):
                if prev not in walk.facts_seen:
                    walk.push(prev, walk.facts[prev])
        return self._events_in_order(txn, walk, result)

    async def get_missing_events(
        self, room_id: str, earliest_events: Sequence[str], latest_events: Sequence[str], limit: int
    ) -> list[dict]:
        """Events a server lacks between what it has and what it got, in
        topological order (oldest first), at most ``limit`` of them.

        These are the ancestors of ``latest_events`` (the events themselves
        excluded: the asking server has them) that are neither one of
        ``earliest_events`` nor an ancestor of one (the asking server has
        those too). Walked from the latest events deepest first, so with
        ``limit`` the ones nearest ``latest_events`` come back (Synapse's
        walk, which stops at the earliest events; this one also never strays
        into their history through another branch). Relies on events being
        deeper than their prev events, as depth is defined. Unknown events,
        outliers and events of other rooms are ignored; rejected events are
        walked through but not returned.
        """
        if limit <= 0 or not latest_events:
            return []
        return await self.db.run_interaction(
            "get_missing_events", self._missing_txn, room_id, list(earliest_events), list(latest_events), limit
        )

    def _missing_txn(
        self, txn: Transaction, room_id: str, earliest: list[str], latest: list[str], limit: int
    ) -> list[dict]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        nids = self.interners.events.lookup(txn, [*earliest, *latest])
        earliest_nids = {nids[e] for e in earliest if e in nids}
        latest_nids = {nids[e] for e in latest if e in nids}
        walk = _GraphWalk(txn, room_nid)
        # excluded[n]: n is an earliest event or an ancestor of one. Set from
        # children as they are popped: deepest first, every child of n is
        # popped before n, so it is final when n is popped.
        excluded: dict[int, bool] = {}
        candidates = 0  # queued nodes not (yet) known to be excluded
        for nid, facts in walk.graph_events(earliest_nids | latest_nids).items():
            excluded[nid] = nid in earliest_nids
            candidates += not excluded[nid]
            walk.push(nid, facts)
        result: list[int] = []
        while walk.heap and candidates and len(result) < limit:
            nid = walk.pop()
            if not excluded[nid]:
                candidates -= 1
                if nid not in latest_nids and not walk.facts[nid].rejected:
                    result.append(nid)
            for prev in walk.prevs_of(nid):
                if prev not in walk.facts_seen:
                    excluded[prev] = excluded[nid]
                    candidates += not excluded[prev]
                    walk.push(prev, walk.facts[prev])
                elif excluded[nid] and not excluded[prev] and not walk.popped(prev):
                    excluded[prev] = True
                    candidates -= 1
        return self._events_in_order(txn, walk, result)

    def _events_in_order(self, txn: Transaction, walk: _GraphWalk, nids: list[int]) -> list[dict]:
        if not nids:
            return []
        ids = self.interners.events.resolve(txn, nids)
        events = self.events.events_txn(txn, [ids[n] for n in nids])
        ordered = sorted(nids, key=lambda n: (walk.facts[n].topo, walk.facts[n].stream))
        return [events[ids[n]] for n in ordered if ids[n] in events]


@attrs.frozen
class _Facts:
    topo: int
    stream: int
    rejected: bool


class _GraphWalk:
    """A deepest-first walk over one room's stored, non-outlier events.

    Prev edges are loaded in batches: whenever a popped event's prev events
    are needed, those of every queued event not loaded yet come with them,
    so a walk costs a statement per layer of the graph, not per event.
    """

    def __init__(self, txn: Transaction, room_nid: int):
        self.txn = txn
        self.room_nid = room_nid
        self.heap: list[tuple[int, int, int]] = []
        self.facts: dict[int, _Facts] = {}
        self.facts_seen: set[int] = set()  # pushed at some point
        self._popped: set[int] = set()
        self._prevs: dict[int, list[int]] = {}

    def graph_events(self, nids: Iterable[int]) -> dict[int, _Facts]:
        """Facts of those ``nids`` that are stored non-outlier events of the room."""
        found: dict[int, _Facts] = {}
        for part in chunks(sorted(set(nids))):
            for nid, topo, stream, rejected in graph_facts_txn(self.txn, part, self.room_nid):
                found[nid] = _Facts(topo, stream, rejected is not None)
        self.facts.update(found)
        return found

    def push(self, nid: int, facts: _Facts) -> None:
        self.facts_seen.add(nid)
        heapq.heappush(self.heap, (-facts.topo, -facts.stream, nid))

    def pop(self) -> int:
        nid = heapq.heappop(self.heap)[2]
        self._popped.add(nid)
        return nid

    def popped(self, nid: int) -> bool:
        return nid in self._popped

    def prevs_of(self, nid: int) -> list[int]:
        """``nid``'s prev events that are stored non-outlier events of the room."""
        if nid not in self._prevs:
            batch = [nid] + [n for _, _, n in self.heap if n not in self._prevs and n != nid]
            self._load_prevs(batch[:500])
        return self._prevs[nid]

    def _load_prevs(self, nids: list[int]) -> None:
        for nid in nids:
            self._prevs[nid] = []
        for child, prev, topo, stream, rejected in prev_facts_txn(self.txn, nids, self.room_nid):
            self._prevs[child].append(prev)
            self.facts.setdefault(prev, _Facts(topo, stream, rejected is not None))
