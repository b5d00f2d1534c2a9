"""Executor side for a Synapse database: a room's string rows through the same :class:`RoomCompactor`.

Synapse's ``state_groups_state`` holds strings (``type``, ``state_key``,
``event_id``). :func:`make_synapse_room_function` interns them per room into
the integers :class:`~roomstore.compaction.job.executor.RoomCompactor` works
on, plans and verifies exactly as for roomstore's tables (with
``allow_removals=False``: Synapse's deltas cannot remove a key), and turns the
rows to write back into strings. The per-row checksum the swap re-checks is
:data:`roomstore.compaction.synapse_sql.CHECKSUM_SQL`, computed by PostgreSQL
in the read itself (``row_checksum``) and summed here per group. Pure Python
plus numpy/pyarrow, like the roomstore executor.

Memory: besides the chunk, a room's interning tables (one entry per distinct
``(type, state_key)`` and per distinct event ID seen in the room).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from roomstore.compaction.chunks import ChunkResult
from roomstore.compaction.job.executor import (
    INPUT_COLUMNS,
    ChunkError,
    RoomCompactor,
    _result_row,
    iter_chunks,
    room_rows,
)

#: Columns of the rows fed to the Synapse room function (after ``room_nid``).
SYNAPSE_COLUMNS = (
    "sort_id",
    "kind",
    "state_group",
    "prev_state_group",
    "type",
    "state_key",
    "event_id",
    "row_checksum",
)


class _Interner:
    """Strings of one room <-> the integers the compactor works on."""

    def __init__(self) -> None:
        self.key_ids: dict[tuple[str, str], int] = {}
        self.keys: list[tuple[str, str]] = []
        self.event_ids: dict[str, int] = {}
        self.events: list[str] = []

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


def _int_batches(batches, interner: _Interner, checksums: dict[int, int]) -> Iterator[pa.RecordBatch]:
    """The room's string batches as integer batches in :data:`INPUT_COLUMNS`
    (``chain_length`` 0: Synapse keeps none); each group's checksum (the sum
    of its rows' ``row_checksum``, computed by PostgreSQL as it reads them,
    :data:`~roomstore.compaction.synapse_sql.CHECKSUM_SQL`) is added to
    ``checksums``. Vectorised: the strings are dictionary-encoded per batch,
    so Python touches each distinct string of a batch once, not each row."""
    for batch in batches:
        n = batch.num_rows
        if n == 0:
            continue
        types = pc.dictionary_encode(batch.column("type"))
        keys = pc.dictionary_encode(batch.column("state_key"))
        events = pc.dictionary_encode(batch.column("event_id"))
        t_idx = pc.fill_null(types.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        has_row = t_idx >= 0
        k_idx = pc.fill_null(keys.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        e_idx = pc.fill_null(events.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        tk = np.full(n, -1, dtype=np.int64)
        ev = np.full(n, -1, dtype=np.int64)
        if has_row.any():
            # (type, state_key) pairs by their codes in this batch's two dictionaries.
            pair = t_idx[has_row] * max(1, len(keys.dictionary)) + k_idx[has_row]
            uniq, inverse = np.unique(pair, return_inverse=True)
            type_names = types.dictionary.to_pylist()
            key_names = keys.dictionary.to_pylist()
            width = max(1, len(key_names))
            pair_ids = np.array(
                [interner.key(type_names[int(c) // width], key_names[int(c) % width]) for c in uniq.tolist()],
                dtype=np.int64,
            )
            tk[has_row] = pair_ids[inverse]
            event_ids = np.array([interner.event(e) for e in events.dictionary.to_pylist()], dtype=np.int64)
            ev[has_row] = event_ids[e_idx[has_row]]
        sg = batch.column("state_group").to_numpy(zero_copy_only=False).astype(np.int64)
        kind = batch.column("kind").to_numpy(zero_copy_only=False).astype(np.int64)
        counted = has_row & (kind == 1)
        if counted.any():
            ck = pc.fill_null(batch.column("row_checksum"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            groups, inverse = np.unique(sg[counted], return_inverse=True)
            sums = np.zeros(len(groups), dtype=np.int64)
            np.add.at(sums, inverse, ck[counted])
            for group, total in zip(groups.tolist(), sums.tolist(), strict=True):
                checksums[group] = checksums.get(group, 0) + total
        yield pa.RecordBatch.from_pydict(
            {
                "sort_id": batch.column("sort_id"),
                "kind": batch.column("kind"),
                "state_group": batch.column("state_group"),
                "prev_state_group": pc.fill_null(batch.column("prev_state_group"), -1),
                "chain_length": pa.array(np.zeros(n, dtype=np.int64)),
                "type_key_nid": pa.array(tk),
                "event_nid": pa.array(ev),
            }
        )


def _to_synapse(result: ChunkResult, interner: _Interner, checksums: dict[int, int]) -> ChunkResult:
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


def _row(room_nid: int, result: ChunkResult, is_last: bool) -> dict[str, Any]:
    rows = result.deltas
    result.deltas = np.zeros((0, 3), dtype=np.int64)
    row = _result_row(room_nid, result, is_last)
    row["deltas_blob"] = json.dumps(rows, separators=(",", ":")).encode() if isinstance(rows, list) else b""
    return row


def decode_deltas(blob: bytes) -> list[tuple[int, str, str, str]]:
    """The driver's side of :func:`_row`'s deltas."""
    if not blob:
        return []
    return [(int(g), t, k, e) for g, t, k, e in json.loads(bytes(blob).decode())]


def make_synapse_room_function(config: Mapping[str, Any]):
    """The grouped-map function for ``applyInArrow`` on Synapse's rows (iterator form);
    same ``config`` and output rows as :func:`~roomstore.compaction.job.executor.make_room_function`."""
    cfg = dict(config)

    def compact_room(key: tuple[pa.Scalar, ...], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        room_nid = key[0].as_py()
        compactor = RoomCompactor(
            room_nid,
            strategy=cfg["strategy"],
            levels=cfg["levels"],
            max_hops=cfg["max_hops"],
            window=cfg["window"],
            emit=cfg["emit"],
            fault=cfg.get("fault_room") == room_nid,
            allow_removals=False,
        )
        interner = _Interner()
        checksums: dict[int, int] = {}
        starts = cfg.get("starts", {}).get(room_nid, ())

        def results() -> Iterator[ChunkResult]:
            for arrays in iter_chunks(_int_batches(batches, interner, checksums), starts):
                result = _to_synapse(compactor.process_chunk(arrays), interner, checksums)
                for gid in set(arrays["state_group"].tolist()):
                    checksums.pop(gid, None)
                yield result

        yield from room_rows(room_nid, results(), batches, _row)

    return compact_room


assert INPUT_COLUMNS == (
    "sort_id",
    "kind",
    "state_group",
    "prev_state_group",
    "chain_length",
    "type_key_nid",
    "event_nid",
)
