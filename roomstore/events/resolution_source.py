"""What state resolution reads (``roomstore.resolution.EventSource``),
answered inside a write's transaction: stored events from their rows and
``event_auth_edges``, the batch's own events (not yet written) from memory.

Synchronous, as the algorithms are: they run in the write's database
thread, in its transaction, so they see exactly what the write sees.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from roomstore.events.tables.event_graph import auth_chain_masks_txn, auth_edges_txn
from roomstore.events.tables.events import served_rows_txn
from roomstore.events.write.batch import PreparedEvent
from roomstore.pdu.parsing import ParsedPdu, stored_pdu
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS
from roomstore.resolution import conflicted_subgraph, resolve_state
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners, LruCache, chunks

#: State sets one masked walk takes (a bit each in a 64-bit integer); more
#: are walked a set at a time.
MAX_MASKED_SETS = 62


class ParsedEventCache(LruCache):
    """Stored events as state resolution and the auth checks read them,
    across transactions: event ID -> (``ParsedPdu``, rejected). A stored
    event's fields the rules read never change (censoring a redacted event
    keeps them: the redaction algorithm keeps what authorization needs), nor
    does its rejection; a purge of events must drop them here too, and
    ``clear`` does, with their auth edges (``auth_edges``)."""

    def __init__(self, max_size: int = 20_000) -> None:
        super().__init__(max_size)
        self.auth_edges = AuthEdgeCache()

    def clear(self) -> None:
        super().clear()
        self.auth_edges.clear()


class AuthEdgeCache:
    """Stored events' auth edges, event nid -> its auth events' nids, across
    transactions, so that the auth chain walks of resolution run in memory:
    a big room's chains are most of its events, and one recursive query of
    them costs PostgreSQL more than the resolution itself.

    An event's auth edges are written with it and never change; only an
    event with edges is kept (one without may be an auth event not stored
    yet, whose edges come with it later). Bounded: past ``max_size`` the
    older half goes (dicts keep insertion order)."""

    def __init__(self, max_size: int = 500_000) -> None:
        self.max_size = max_size
        self._edges: dict[int, tuple[int, ...]] = {}

    def edges_of(self, txn: Transaction, nids: Iterable[int]) -> Mapping[int, tuple[int, ...]]:
        """A mapping holding the edges of every stored one of ``nids`` that
        has any (and maybe others): read from ``event_auth_edges`` once."""
        edges = self._edges
        missing = [nid for nid in nids if nid not in edges]
        if missing:
            self.remember({nid: tuple(auths) for nid, auths in auth_edges_txn(txn, missing).items()})
        return edges

    def remember(self, found: Mapping[int, tuple[int, ...]]) -> None:
        """Keep ``found``, stored events' whole edges: read from the table
        (``edges_of``), or those of a write's events once it commits, so
        that the next writes' walks need not read them back (a create
        event's none too: it has all it will ever have)."""
        edges = self._edges
        if len(edges) + len(found) > self.max_size:
            for nid in list(itertools.islice(edges, len(edges) // 2)):
                del edges[nid]
        edges.update(found)

    def clear(self) -> None:
        self._edges.clear()


class TransactionEventSource:
    """Events by ID, rejected flags and the auth graph, for one write.

    ``pending``: the batch's events by ID, which the tables do not hold yet.
    Stored events are read from their stored bytes once and kept
    (``stored_pdu``: parse_pdu checked them when they were stored), in
    ``cache`` across transactions where given (``ParsedEventCache``).
    """

    def __init__(
        self,
        txn: Transaction,
        interners: Interners,
        pending: Mapping[str, PreparedEvent],
        cache: ParsedEventCache | None = None,
    ) -> None:
        self.txn = txn
        self.interners = interners
        self.pending = pending
        self.cache = cache
        self._pending_nids = interners.events.lookup(txn, pending) if pending else {}
        self._parsed: dict[str, ParsedPdu | None] = {}
        self._rejected: set[str] = set()

    def get_events(self, event_ids: Iterable[str]) -> Mapping[str, ParsedPdu]:
        event_ids = list(event_ids)  # read twice below
        wanted = [e for e in set(event_ids) if e not in self.pending and e not in self._parsed]
        if wanted and self.cache is not None:
            wanted = self._from_cache(self.cache, wanted)
        if wanted:
            nids = self.interners.events.lookup(self.txn, wanted)
            by_nid = {nid: event_id for event_id, nid in nids.items()}
            self._parsed.update((e, None) for e in wanted)
            for part in chunks(sorted(by_nid)):
                for nid, version, raw, _, _, rejected, _ in served_rows_txn(self.txn, part):
                    event_id = by_nid[nid]
                    room_version = KNOWN_ROOM_VERSIONS.get(version)
                    try:
                        self._parsed[event_id] = (
                            stored_pdu(bytes(raw), room_version, event_id) if room_version else None
                        )
                    except (ValueError, KeyError, TypeError, IndexError):
                        continue  # not a PDU now (a tampered database): unknown to the resolution
                    if rejected is not None:
                        self._rejected.add(event_id)
                    if self.cache is not None and self._parsed[event_id] is not None:
                        self.cache.set(event_id, (self._parsed[event_id], rejected is not None))
        found: dict[str, ParsedPdu] = {}
        for event_id in event_ids:
            if event_id in self.pending:
                found[event_id] = self.pending[event_id].pdu
            elif (pdu := self._parsed.get(event_id)) is not None:
                found[event_id] = pdu
        return found

    def _from_cache(self, cache: ParsedEventCache, wanted: list[str]) -> list[str]:
        """Take what the cache holds of ``wanted``; returns the rest."""
        rest = []
        for event_id in wanted:
            hit = cache.get(event_id)
            if hit is None:
                rest.append(event_id)
                continue
            self._parsed[event_id] = hit[0]
            if hit[1]:
                self._rejected.add(event_id)
        return rest

    def rejected(self, event_ids: Iterable[str]) -> set[str]:
        return {
            e
            for e in event_ids
            if e in self._rejected or (e in self.pending and self.pending[e].rejected_reason is not None)
        }

    def auth_chain_difference(self, state_sets: Sequence[set[str]]) -> set[str]:
        """∪ − ∩ of the sets' full auth chains (each with its own events).

        One walk for all the sets: every event carries a bit mask of the sets
        whose closure reaches it, so the events the sets share (most of a big
        room's state) are walked once, not once a set. The batch's events
        are walked in memory, the stored part in one recursive query
        (``auth_chain_masks_txn``); an event is in the difference unless
        every set's bit reached it. Compared as nids, named at the end."""
        if not state_sets:
            return set()
        if len(state_sets) > MAX_MASKED_SETS:
            closures = [self._closure(state_set) for state_set in state_sets]
            return self._named(set().union(*closures) - set.intersection(*closures))
        full = (1 << len(state_sets)) - 1
        masks: dict = {}  # nid (by ID where it has none) -> the sets reaching it
        stored: dict[str, int] = {}
        for index, state_set in enumerate(state_sets):
            self._walk_pending(state_set, 1 << index, masks, stored)
        nids = self.interners.events.lookup(self.txn, stored)
        start: dict[int, int] = {}
        for event_id, mask in stored.items():
            key = nids.get(event_id, event_id)
            masks[key] = masks.get(key, 0) | mask
            if event_id in nids:
                start[nids[event_id]] = mask
        for nid, mask in self._stored_masks(start).items():
            masks[nid] = masks.get(nid, 0) | mask
        return self._named({key for key, mask in masks.items() if mask != full})

    def _stored_masks(self, start: Mapping[int, int]) -> dict[int, int]:
        """``auth_chain_masks_txn``'s answer (nid -> the OR of the masks of
        the ``start`` events whose auth chain holds it), walked in memory
        over the cache's auth edges where there is a cache: a level of the
        chains a read of the edges it lacks. Only bits new to an event are
        pushed on, so each (event, bit) is walked once, cycles included."""
        if self.cache is None:
            return auth_chain_masks_txn(self.txn, start)
        found: dict[int, int] = {}
        frontier = dict(start)
        while frontier:
            edges = self.cache.auth_edges.edges_of(self.txn, frontier)
            following: dict[int, int] = {}
            for nid, bits in frontier.items():
                for auth_nid in edges.get(nid, ()):
                    had = found.get(auth_nid, 0)
                    new = bits & ~had
                    if new:
                        found[auth_nid] = had | new
                        following[auth_nid] = following.get(auth_nid, 0) | new
            frontier = following
        return found

    def _named(self, keys: set) -> set[str]:
        """Event IDs of nids and IDs (an event without a nid is its ID)."""
        names = self.interners.events.resolve(self.txn, [n for n in keys if isinstance(n, int)])
        return {n for n in keys if isinstance(n, str)} | set(names.values())

    def _walk_pending(self, start: Iterable[str], bit: int, masks: dict, stored: dict[str, int]) -> None:
        """Mark ``start`` and the batch's events of its auth chain with
        ``bit`` in ``masks`` (by nid where interned, as a stored event's edge
        would name them); the stored events it meets with ``bit`` in ``stored``."""
        frontier, seen = set(start), set()
        while frontier:
            seen |= frontier
            following: set[str] = set()
            for event_id in frontier:
                ev = self.pending.get(event_id)
                if ev is None:
                    stored[event_id] = stored.get(event_id, 0) | bit
                    continue
                key = self._pending_nids.get(event_id, event_id)
                masks[key] = masks.get(key, 0) | bit
                following.update(ev.pdu.auth_chain_event_ids)
            frontier = following - seen

    def conflicted_subgraph(self, conflicted: set[str]) -> set[str]:
        """The pure walk (``roomstore.resolution.conflicted_subgraph``) over
        the auth edges of the conflicted events' chains, read at once."""
        closure = self._closure(conflicted)
        stored = [n for n in closure if isinstance(n, int)]
        names = self.interners.events.resolve(self.txn, stored)
        stored_edges = (
            self.cache.auth_edges.edges_of(self.txn, stored)
            if self.cache is not None
            else auth_edges_txn(self.txn, stored)
        )
        edges = {
            names[n]: [names[a] for a in stored_edges[n] if a in names]
            for n in stored
            if n in names and n in stored_edges
        }
        for event_id, ev in self.pending.items():
            edges[event_id] = list(ev.pdu.auth_chain_event_ids)
        return conflicted_subgraph(conflicted, lambda event_id: edges.get(event_id, ()))

    def _closure(self, start: Iterable[str]) -> set:
        """``start`` and its auth chain: the batch's events by ID (walked in
        memory), stored ones by nid (``_stored_masks``), unknown ones
        by ID."""
        masks: dict = {}
        stored: dict[str, int] = {}
        self._walk_pending(start, 1, masks, stored)
        nids = self.interners.events.lookup(self.txn, stored)
        closure = set(masks) | {e for e in stored if e not in nids} | set(nids.values())
        return closure | set(self._stored_masks(dict.fromkeys(nids.values(), 1)))


def resolve_interned(w, room_version, states: Sequence[Mapping[int, int]]) -> dict[int, int]:
    """State resolution of interned states (state key nid -> event nid) in
    the batch writer ``w``'s transaction (``roomstore.events.write.persist``):
    named for the algorithm, resolved, interned back. The result may hold
    an event of none of the inputs: v2 resolves the auth chains'
    difference too, whose power events can win a key."""
    w.names_of_keys({k for state in states for k in state})
    event_nids = {e for state in states for e in state.values()}
    names = w.p.interners.events.resolve(w.txn, event_nids)
    named = [{w.key_names[k]: names[e] for k, e in state.items()} for state in states]
    resolved = resolve_state(room_version, named, w.event_source)
    event_nid_of = {event_id: nid for nid, event_id in names.items()}
    others = [e for e in resolved.values() if e not in event_nid_of]
    if others:
        # Known events (resolution read them), so interned already.
        event_nid_of.update(w.p.interners.events.lookup(w.txn, others))
        w.intern_keys(resolved)
    return {w.key_nids[key]: event_nid_of[event_id] for key, event_id in resolved.items()}
