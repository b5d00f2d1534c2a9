"""The event graph's tables: ``event_edges`` (each event's prev events) and
``event_auth_edges`` (its auth events), and every statement that names them:
writing a batch's edges, the prev facts federation and current state read,
the auth chains state resolution and ``get_auth_chain`` walk (one recursive
query a chunk), and what a purge reads and deletes of them.

The edges name events by nid, stored or not (a prev event may be missing:
a backward extremity). Reads that need the named events' rows join
``events`` through its owner's fragment (``tables.events.join_events``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from roomstore.events.tables.events import join_events
from roomstore.storage.database import Transaction
from roomstore.storage.interning import chunks

# ---------------------------------------------------------------------- writes


def insert_edges(txn: Transaction, prev_rows: Sequence[tuple], auth_rows: Sequence[tuple]) -> None:
    """Write ``(event_nid, prev_event_nid)`` and ``(event_nid, auth_event_nid)`` rows (new events only)."""
    txn.copy_rows("event_edges", ("event_nid", "prev_event_nid"), prev_rows)
    txn.copy_rows("event_auth_edges", ("event_nid", "auth_event_nid"), auth_rows)


# ---------------------------------------------------------------------- prev events


def prev_facts_txn(txn: Transaction, nids: Sequence[int], room_nid: int) -> list[tuple]:
    """``(child, prev, topo, stream, rejected_reason)`` of the prev events of
    ``nids`` that are non-outliers of the room, by child then prev."""
    marks = ", ".join("?" for _ in nids)
    return txn.execute(
        "SELECT ed.event_nid, p.event_nid, p.topological_ordering, p.stream_ordering, p.rejected_reason"
        f" FROM event_edges AS ed {join_events('p', 'p.event_nid = ed.prev_event_nid')}"
        f" WHERE ed.event_nid IN ({marks}) AND p.room_nid = ? AND p.outlier = ?"
        " ORDER BY ed.event_nid, p.event_nid",
        [*nids, room_nid, False],
    ).fetchall()


def pointed_at_txn(txn: Transaction, nids: Iterable[int]) -> set[int]:
    """Those of ``nids`` that some stored non-outlier, not rejected, names as a prev event."""
    found: set[int] = set()
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        found.update(
            r[0]
            for r in txn.execute(
                "SELECT DISTINCT prev_event_nid FROM event_edges AS ed"
                f" {join_events('e', 'e.event_nid = ed.event_nid')} WHERE ed.prev_event_nid IN ({marks})"
                " AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed",
                (*part, False),
            ).fetchall()
        )
    return found


# ---------------------------------------------------------------------- auth chains


#: Starting events per auth-chain query: a state's chains start from every
#: state event (10,000 in a large room), and each query has a plan to make
#: (about 10 ms on PostgreSQL whatever its size, bench/state_resolution.py);
#: below SQLite's 32,766 parameters (3.32 and later).
WIDE_CHUNK = 10_000


def auth_chain_nids_txn(txn: Transaction, nids: Iterable[int]) -> set[int]:
    """The auth chain of the events ``nids``: their auth events, theirs, and
    so on (the events themselves only where one is in another's chain).
    One recursive query a chunk of starting events; ``UNION`` ends it on any
    graph, a cycle of forged auth events included."""
    found: set[int] = set()
    for part in chunks(sorted(set(nids)), WIDE_CHUNK):
        marks = ", ".join("?" for _ in part)
        found.update(
            r[0]
            for r in txn.execute(
                "WITH RECURSIVE chain(nid) AS ("
                f" SELECT auth_event_nid FROM event_auth_edges WHERE event_nid IN ({marks})"
                " UNION SELECT a.auth_event_nid FROM event_auth_edges AS a JOIN chain AS c ON a.event_nid = c.nid"
                ") SELECT nid FROM chain",
                list(part),
            ).fetchall()
        )
    return found


def auth_chain_masks_txn(txn: Transaction, start: Mapping[int, int]) -> dict[int, int]:
    """nid -> the OR of the masks of the events of ``start`` (nid -> mask)
    whose auth chain holds it (the start events themselves only where one is
    in another's chain). One recursive query a chunk: each mask's events
    anchor it, and a (nid, mask) pair is walked once (``UNION``), so events
    that several masks share are walked once under their common mask."""
    found: dict[int, int] = {}
    for part in chunks(sorted(start.items()), WIDE_CHUNK):
        by_mask: dict[int, list[int]] = {}
        for nid, mask in part:
            by_mask.setdefault(mask, []).append(nid)
        anchors, params = [], []
        for mask, nids in sorted(by_mask.items()):
            anchors.append(
                "SELECT auth_event_nid, CAST(? AS BIGINT) FROM event_auth_edges"
                f" WHERE event_nid IN ({', '.join('?' for _ in nids)})"
            )
            params += [mask, *nids]
        for nid, mask in txn.execute(
            f"WITH RECURSIVE chain(nid, mask) AS ({' UNION '.join(anchors)}"
            " UNION SELECT a.auth_event_nid, c.mask FROM event_auth_edges AS a JOIN chain AS c ON a.event_nid = c.nid"
            ") SELECT nid, mask FROM chain",
            params,
        ).fetchall():
            found[nid] = found.get(nid, 0) | mask
    return found


def auth_edges_txn(txn: Transaction, nids: Iterable[int]) -> dict[int, list[int]]:
    """nid -> its auth events' nids, for the stored events among ``nids``
    that have any."""
    edges: dict[int, list[int]] = {}
    for part in chunks(sorted(set(nids))):
        marks = ", ".join("?" for _ in part)
        for nid, auth_nid in txn.execute(
            f"SELECT event_nid, auth_event_nid FROM event_auth_edges WHERE event_nid IN ({marks})", list(part)
        ).fetchall():
            edges.setdefault(nid, []).append(auth_nid)
    return edges


# ---------------------------------------------------------------------- purging (roomstore.events.purge)


def edge_targets_txn(txn: Transaction, nids: Sequence[int]) -> set[int]:
    """The prev and auth events (stored or not) that the events ``nids`` name."""
    found: set[int] = set()
    for part in chunks(sorted(set(nids))):
        marks = ", ".join("?" for _ in part)
        found.update(
            r[0]
            for r in txn.execute(
                f"SELECT prev_event_nid FROM event_edges WHERE event_nid IN ({marks})"
                f" UNION SELECT auth_event_nid FROM event_auth_edges WHERE event_nid IN ({marks})",
                list(part) * 2,
            ).fetchall()
        )
    return found


def room_prevs_txn(txn: Transaction, room_nid: int) -> set[int]:
    """The prev events that the room's graph events (not outliers) name:
    with those events (``tables.events.graph_nids_txn``), what its backward
    extremities are made of."""
    return {
        r[0]
        for r in txn.execute(
            f"SELECT DISTINCT ed.prev_event_nid FROM event_edges AS ed {join_events('e', 'e.event_nid = ed.event_nid')}"
            " WHERE e.room_nid = ? AND e.outlier = ?",
            (room_nid, False),
        ).fetchall()
    }


def referenced_nids_txn(txn: Transaction, nids: Iterable[int]) -> set[int]:
    """Those of ``nids`` that a stored edge names as a prev or auth event."""
    found: set[int] = set()
    for part in chunks(sorted(set(nids))):
        marks = ", ".join("?" for _ in part)
        found.update(
            r[0]
            for r in txn.execute(
                f"SELECT prev_event_nid FROM event_edges WHERE prev_event_nid IN ({marks})"
                f" UNION SELECT auth_event_nid FROM event_auth_edges WHERE auth_event_nid IN ({marks})",
                list(part) * 2,
            ).fetchall()
        )
    return found


def delete_edges_txn(txn: Transaction, nids: Sequence[int], counts: dict[str, int]) -> None:
    """Delete the prev and auth edges of the events ``nids``; ``counts``
    gains the rows deleted per table."""
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        for table in ("event_edges", "event_auth_edges"):
            txn.execute(f"DELETE FROM {table} WHERE event_nid IN ({marks})", list(part))
            counts[table] = counts.get(table, 0) + max(txn.rowcount, 0)
