"""Executor side for a Synapse database: a room's string rows through the same :class:`RoomCompactor`.

Synapse's ``state_groups_state`` holds strings (``type``, ``state_key``,
``event_id``). :func:`make_synapse_room_function` interns them per room into
the integers :class:`~roomstore.compaction.job.executor.RoomCompactor` works
on, plans and verifies exactly as for roomstore's tables (with
``allow_removals=False``: Synapse's deltas cannot remove a key), and turns the
rows to write back into strings. The per-row checksum the swap re-checks is
:func:`text_row_checksum` (its SQL form is in
:mod:`roomstore.compaction.synapse_sql`). Pure Python plus numpy/pyarrow, like
the roomstore executor.

Memory: besides the chunk, a room's interning tables (one entry per distinct
``(type, state_key)`` and per distinct event ID seen in the room).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import numpy as np
import pyarrow as pa

from roomstore.compaction.job.executor import (
    INPUT_COLUMNS,
    ChunkError,
    ChunkResult,
    RoomCompactor,
    _result_row,
    iter_chunks,
    room_rows,
)

#: Columns of the rows fed to the Synapse room function (after ``room_nid``).
SYNAPSE_COLUMNS = ("sort_id", "kind", "state_group", "prev_state_group", "type", "state_key", "event_id")


def text_row_checksum(event_type: str, state_key: str, event_id: str) -> int:
    """28 bits of the MD5 of one row's strings (``\\x01``-separated); a group's
    checksum is the sum over its rows. Only meant to catch accidental change."""
    digest = hashlib.md5(f"{event_type}\x01{state_key}\x01{event_id}".encode()).hexdigest()
    return int(digest[:7], 16)


class _Interner:
    """Strings of one room <-> the integers the compactor works on."""

    def __init__(self) -> None:
        self.key_ids: Dict[Tuple[str, str], int] = {}
        self.keys: List[Tuple[str, str]] = []
        self.event_ids: Dict[str, int] = {}
        self.events: List[str] = []

    def key(self, event_type: str, state_key: str) -> int:
        pair = (event_type, state_key)
        nid = self.key_ids.get(pair)
        if nid is None:
            nid = self.key_ids[pair] = len(self.keys)
            self.keys.append(pair)
        return nid

    def event(self, event_id: str) -> int:
        nid = self.event_ids.get(event_id)
        if nid is None:
            nid = self.event_ids[event_id] = len(self.events)
            self.events.append(event_id)
        return nid


def _int_batches(batches, interner: _Interner, checksums: Dict[int, int]) -> Iterator[pa.RecordBatch]:
    """The room's string batches as integer batches in :data:`INPUT_COLUMNS`
    (``chain_length`` 0: Synapse keeps none); each group's text checksum is
    added to ``checksums``."""
    for batch in batches:
        if batch.num_rows == 0:
            continue
        cols = {name: batch.column(name).to_pylist() for name in SYNAPSE_COLUMNS}
        n = batch.num_rows
        tk = np.empty(n, dtype=np.int64)
        ev = np.empty(n, dtype=np.int64)
        for i, (kind, group, t, k, e) in enumerate(
            zip(cols["kind"], cols["state_group"], cols["type"], cols["state_key"], cols["event_id"])
        ):
            if t is None:
                tk[i] = ev[i] = -1
                continue
            tk[i] = interner.key(t, k)
            ev[i] = interner.event(e)
            if kind == 1:
                checksums[group] = checksums.get(group, 0) + text_row_checksum(t, k, e)
        prev = [-1 if p is None else p for p in cols["prev_state_group"]]
        yield pa.RecordBatch.from_pydict(
            {
                "sort_id": pa.array(cols["sort_id"], pa.int64()),
                "kind": pa.array(cols["kind"], pa.int64()),
                "state_group": pa.array(cols["state_group"], pa.int64()),
                "prev_state_group": pa.array(prev, pa.int64()),
                "chain_length": pa.array(np.zeros(n, dtype=np.int64)),
                "type_key_nid": pa.array(tk),
                "event_nid": pa.array(ev),
            }
        )


def _to_synapse(result: ChunkResult, interner: _Interner, checksums: Dict[int, int]) -> ChunkResult:
    """Synapse has no chain_length: only rewrites count; the groups' checksums
    are the text ones; the deltas become ``[group, type, state_key, event_id]``
    rows as JSON (kept in ``deltas``, an object array)."""
    result.chain_updates = 0
    if not result.rewritten:
        result.groups = np.zeros((0, 7), dtype=np.int64)
        result.refs = np.zeros(0, dtype=np.int64)
        result.deltas = np.zeros((0, 3), dtype=np.int64)
        return result
    groups = result.groups.copy()
    for i, gid in enumerate(groups[:, 0].tolist()):
        groups[i, 3] = checksums.get(gid, 0)
    result.groups = groups
    rows = []
    for g, k, e in result.deltas.tolist():
        if e < 0:
            raise ChunkError(f"state group {g}: the plan removes a key, which Synapse's tables cannot store")
        event_type, state_key = interner.keys[k]
        rows.append([g, event_type, state_key, interner.events[e]])
    result.deltas = rows  # type: ignore[assignment]
    return result


def _row(room_nid: int, result: ChunkResult, is_last: bool) -> Dict[str, Any]:
    rows = result.deltas
    result.deltas = np.zeros((0, 3), dtype=np.int64)
    row = _result_row(room_nid, result, is_last)
    row["deltas_blob"] = json.dumps(rows, separators=(",", ":")).encode() if isinstance(rows, list) else b""
    return row


def decode_deltas(blob: bytes) -> List[Tuple[int, str, str, str]]:
    """The driver's side of :func:`_row`'s deltas."""
    if not blob:
        return []
    return [(int(g), t, k, e) for g, t, k, e in json.loads(bytes(blob).decode())]


def make_synapse_room_function(config: Mapping[str, Any]):
    """The grouped-map function for ``applyInArrow`` on Synapse's rows (iterator form);
    same ``config`` and output rows as :func:`~roomstore.compaction.job.executor.make_room_function`."""
    cfg = dict(config)

    def compact_room(key: Tuple[pa.Scalar, ...], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        room_nid = key[0].as_py()
        compactor = RoomCompactor(
            room_nid, strategy=cfg["strategy"], levels=cfg["levels"], max_hops=cfg["max_hops"],
            window=cfg["window"], emit=cfg["emit"], fault=cfg.get("fault_room") == room_nid, allow_removals=False,
        )
        interner = _Interner()
        checksums: Dict[int, int] = {}
        starts = cfg.get("starts", {}).get(room_nid, ())

        def results() -> Iterator[ChunkResult]:
            for arrays in iter_chunks(_int_batches(batches, interner, checksums), starts):
                result = _to_synapse(compactor.process_chunk(arrays), interner, checksums)
                for gid in set(arrays["state_group"].tolist()):
                    checksums.pop(gid, None)
                yield result

        yield from room_rows(room_nid, results(), batches, _row)

    return compact_room


assert INPUT_COLUMNS == ("sort_id", "kind", "state_group", "prev_state_group", "chain_length", "type_key_nid", "event_nid")
