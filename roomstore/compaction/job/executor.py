"""Executor side: one room, chunk by chunk (what Spark's Python workers run).

:func:`make_room_function` is the grouped-map function handed to
``groupBy(room).applyInArrow``; it feeds a room's rows (columns
:data:`INPUT_COLUMNS`, sorted by ``sort_id``) chunk by chunk to a
:class:`RoomCompactor`, which plans with
:class:`~roomstore.compaction.StreamingCompactor`, verifies the plan and
encodes the rows to write (:class:`~roomstore.compaction.chunks.ChunkResult`, one output row per chunk in
:data:`OUTPUT_SCHEMA`). Pure Python plus numpy/pyarrow: no database, no
pyspark import, and nothing that needs roomstore installed (the package
arrives in the ``--py-files`` zip).
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from roomstore.compaction import (
    DEFAULT_LEVELS,
    DEFAULT_WINDOW,
    PlanEntry,
    StateGroupEntry,
    StreamingCompactor,
    verify,
)
from roomstore.compaction.chunks import ChunkResult, row_checksum_np
from roomstore.compaction.states import apply_delta, state_diff

#: Columns of the rows fed to the per-room function; -1 stands for NULL.
#: ``sort_id`` orders a room's rows (see the module docstring); ``kind`` 0 =
#: a boundary state row (``state_group`` is the boundary group;
#: a row with ``type_key_nid`` -1 marks the state as complete, so empty states
#: are represented), 1 = a delta row of a group of the chunk (one row with
#: ``type_key_nid`` -1 for a group without rows).
INPUT_COLUMNS = ("sort_id", "kind", "state_group", "prev_state_group", "chain_length", "type_key_nid", "event_nid")

#: One output row per chunk (Spark DDL). The blobs are int64 arrays
#: (little-endian, C order): groups (n, 7), refs (k,), deltas (m, 3); see
#: :class:`ChunkResult`. They are empty in dry runs and for chunks without
#: changes.
OUTPUT_SCHEMA = (
    "room_nid long, first_group long, last_group long, is_last boolean, status string, detail string, "
    "state_groups long, rows_before long, rows_after long, rewritten long, chain_updates long, missing long, "
    "mismatched long, max_depth long, boundary long, groups_blob binary, refs_blob binary, deltas_blob binary"
)
_OUTPUT_FIELDS = [f.strip().split(" ")[0] for f in OUTPUT_SCHEMA.split(",")]
_ARROW_OUTPUT = pa.schema(
    [
        (
            name,
            pa.bool_()
            if name == "is_last"
            else pa.string()
            if name in ("status", "detail")
            else pa.binary()
            if name.endswith("_blob")
            else pa.int64(),
        )
        for name in _OUTPUT_FIELDS
    ]
)

#: Rewrite an event id to this much above itself to corrupt a plan (tests).
_FAULT_OFFSET = 10**12


class _StateBank:
    """Original full states of the groups the compactor carries between chunks.

    Stored as one full state (the newest group) plus each other group's
    difference from it: carried groups are recent or level heads, so the
    differences are small and memory stays about one state, not
    ``window + levels`` of them.
    """

    def __init__(self) -> None:
        self.base_id: int | None = None
        self.base: dict[int, int] = {}
        self.diffs: dict[int, dict[int, int | None]] = {}

    def __contains__(self, group_id: int) -> bool:
        return group_id == self.base_id or group_id in self.diffs

    def get(self, group_id: int) -> dict[int, int] | None:
        """A fresh copy of the group's state, or None if not held."""
        if group_id == self.base_id:
            return dict(self.base)
        diff = self.diffs.get(group_id)
        if diff is None:
            return None
        return apply_delta(dict(self.base), diff)

    def replace(self, base_id: int | None, base: dict[int, int], diffs: dict[int, dict[int, int | None]]) -> None:
        self.base_id, self.base, self.diffs = base_id, base, diffs


class ChunkError(RuntimeError):
    """The input of a room broke the job's assumptions (order, cycles...)."""


def _empty(shape_cols: int) -> np.ndarray:
    return np.zeros((0, shape_cols), dtype=np.int64) if shape_cols else np.zeros(0, dtype=np.int64)


@attrs.define
class _EncodedChunk:
    """What :meth:`RoomCompactor.process_chunk` builds, group by group."""

    local_depth: dict[int, int] = attrs.Factory(dict)
    group_rows: list[tuple[int, ...]] = attrs.Factory(list)
    d_sg: list[int] = attrs.Factory(list)
    d_tk: list[int] = attrs.Factory(list)
    d_ev: list[int] = attrs.Factory(list)
    new_entries: list[StateGroupEntry] = attrs.Factory(list)
    refs: set = attrs.Factory(set)
    rewritten: int = 0
    chain_updates: int = 0
    max_depth: int = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(groups, refs, deltas)`` as the job stages them."""
        return (
            np.array(self.group_rows, dtype=np.int64).reshape(-1, 7),
            np.array(sorted(self.refs), dtype=np.int64),
            np.array([self.d_sg, self.d_tk, self.d_ev], dtype=np.int64).T.reshape(-1, 3),
        )


class RoomCompactor:
    """Compacts and verifies one room, fed chunk by chunk (executor side).

    Feed :meth:`process_chunk` the room's chunks in order (arrays as in
    :data:`INPUT_COLUMNS`, boundary rows first, group rows sorted by id then
    key). Memory: the current chunk, the compactor's carry-over, and the
    carried groups' states in a :class:`_StateBank` (about one full state).

    ``emit=False`` (dry runs) skips building the arrays to write; ``fault``
    corrupts one delta row of the first chunk that rewrites anything, after
    planning and before verification (tests prove such a room is refused).
    """

    def __init__(
        self,
        room_nid: int,
        *,
        strategy: str = "smart",
        levels: Sequence[int] = DEFAULT_LEVELS,
        max_hops: int | None = None,
        window: int = DEFAULT_WINDOW,
        emit: bool = True,
        fault: bool = False,
        allow_removals: bool = True,
    ) -> None:
        self.room_nid = room_nid
        self.emit = emit
        self.fault = fault
        self._boundary: dict[int, dict[int, int]] = {}
        self._bank = _StateBank()
        self._depth: dict[int, int] = {}  # new chain length of carried groups
        self._last_group = -1
        self.compactor = StreamingCompactor(
            strategy,
            levels=levels,
            max_hops=max_hops,
            window=window,
            resolve_state=self._resolve,
            allow_removals=allow_removals,
        )

    def _resolve(self, group_id: int) -> Mapping[int, int] | None:
        # The compactor asks only for predecessors it does not carry; every
        # predecessor across a chunk boundary was read as a boundary state.
        return self._boundary.get(group_id)

    def _known_state(self, group_id: int) -> dict[int, int] | None:
        state = self._bank.get(group_id)
        if state is None and group_id in self._boundary:
            state = dict(self._boundary[group_id])
        return state

    # -- parsing ------------------------------------------------------------

    @staticmethod
    def _parse_boundary(sg: np.ndarray, tk: np.ndarray, ev: np.ndarray) -> dict[int, dict[int, int]]:
        states: dict[int, dict[int, int]] = {}
        complete = set()
        for g, k, e in zip(sg.tolist(), tk.tolist(), ev.tolist(), strict=True):
            if k < 0:
                complete.add(g)
            else:
                states.setdefault(g, {})[k] = e
        return {g: states.get(g, {}) for g in complete}

    def _parse_groups(self, arrays: Mapping[str, np.ndarray], sel: np.ndarray):
        sg = arrays["state_group"][sel]
        prev = arrays["prev_state_group"][sel]
        chain = arrays["chain_length"][sel]
        tk = arrays["type_key_nid"][sel]
        ev = arrays["event_nid"][sel]
        if len(sg) == 0:
            raise ChunkError("a chunk without state groups")
        if np.any(np.diff(sg) < 0) or sg[0] <= self._last_group:
            raise ChunkError("state groups arrived out of order")
        starts = np.flatnonzero(np.r_[True, sg[1:] != sg[:-1]])
        has_row = tk >= 0
        counts = np.add.reduceat(has_row.astype(np.int64), starts)
        sums = np.add.reduceat(np.where(has_row, row_checksum_np(tk, ev), 0), starts)
        ids = sg[starts].tolist()
        prevs = prev[starts].tolist()
        chains = chain[starts].tolist()
        tk_l, ev_l = tk.tolist(), ev.tolist()
        tombstones = bool(np.any(has_row & (ev < 0)))
        bounds = starts.tolist() + [len(sg)]
        entries: list[StateGroupEntry] = []
        for i, gid in enumerate(ids):
            a, z = bounds[i], bounds[i + 1]
            if tk_l[a] < 0:
                delta: dict[int, int | None] = {}
            elif tombstones:
                delta = {k: (None if e < 0 else e) for k, e in zip(tk_l[a:z], ev_l[a:z], strict=True)}
            else:
                delta = dict(zip(tk_l[a:z], ev_l[a:z], strict=True))
            p = prevs[i]
            entries.append(StateGroupEntry(gid, None if p < 0 else p, delta))
        return entries, prevs, chains, counts, sums

    # -- the chunk ----------------------------------------------------------

    def process_chunk(self, arrays: Mapping[str, np.ndarray]) -> ChunkResult:
        """Plan, check and (unless ``emit`` is off) encode one chunk."""
        entries, old_prevs, old_chains, counts, sums = self._read_chunk(arrays)
        plan = self.compactor.feed(entries)
        chunk_ids = {e.group_id for e in entries}
        out = _EncodedChunk()
        for i, planned in enumerate(plan.entries):
            new_prev, new_chain, rewrite = self._new_position(planned, plan.missing, old_prevs[i], old_chains[i], out)
            if rewrite:
                self._encode_rewrite(planned, chunk_ids, out)
            else:
                out.new_entries.append(entries[i])
            if new_chain != old_chains[i]:
                out.chain_updates += 1
            out.group_rows.append(
                (planned.group_id, old_prevs[i], int(counts[i]), int(sums[i]), new_prev, new_chain, 1 if rewrite else 0)
            )
        mismatched = self._verify(entries, out.new_entries, chunk_ids)
        self._carry(entries, out.local_depth)
        groups_arr, refs_arr, deltas_arr = (
            out.arrays() if self.emit and (out.rewritten or out.chain_updates) else (_empty(7), _empty(0), _empty(3))
        )
        return ChunkResult(
            first_group=entries[0].group_id,
            last_group=entries[-1].group_id,
            state_groups=len(entries),
            rows_before=plan.rows_before,
            rows_after=plan.rows_after,
            rewritten=out.rewritten,
            chain_updates=out.chain_updates,
            max_depth=out.max_depth,
            boundary=len(self._boundary),
            missing=dict(plan.missing),
            mismatched=list(mismatched),
            groups=groups_arr,
            refs=refs_arr,
            deltas=deltas_arr,
        )

    def _read_chunk(self, arrays: Mapping[str, np.ndarray]) -> tuple:
        """The chunk's boundary states (kept) and its groups:
        ``(entries, old prevs, old chain lengths, row counts, checksums)``."""
        bsel = arrays["kind"] == 0
        self._boundary = self._parse_boundary(
            arrays["state_group"][bsel], arrays["type_key_nid"][bsel], arrays["event_nid"][bsel]
        )
        parsed = self._parse_groups(arrays, ~bsel)
        self._last_group = parsed[0][-1].group_id
        return parsed

    def _new_position(
        self, planned: PlanEntry, missing: Mapping[int, Any], old_prev: int, old_chain: int, out: _EncodedChunk
    ) -> tuple[int, int, bool]:
        """``(new prev or -1, new chain length, rewrite?)`` of a planned group;
        its depth noted in ``out``."""
        gid = planned.group_id
        if gid in missing:
            # Unknown state: the row stays exactly as it is.
            return old_prev, old_chain, False
        if planned.prev_group is None:
            depth = 0
        else:
            parent = out.local_depth.get(planned.prev_group)
            if parent is None:
                parent = self._depth.get(planned.prev_group)
            if parent is None:
                raise ChunkError(f"state group {gid}: new predecessor {planned.prev_group} is unknown")
            depth = parent + 1
        out.local_depth[gid] = depth
        out.max_depth = max(out.max_depth, depth)
        return (-1 if planned.prev_group is None else planned.prev_group), depth, planned.changed

    def _encode_rewrite(self, planned: PlanEntry, chunk_ids: set, out: _EncodedChunk) -> None:
        """A rewritten group's new delta rows (and the group outside the chunk it builds on)."""
        gid = planned.group_id
        out.rewritten += 1
        if planned.prev_group is not None and planned.prev_group not in chunk_ids:
            out.refs.add(planned.prev_group)
        delta = dict(planned.delta)
        if self.fault:
            for key, value in sorted(delta.items()):
                if value is not None:
                    delta[key] = value + _FAULT_OFFSET
                    self.fault = False
                    break
        for key in sorted(delta):
            value = delta[key]
            out.d_sg.append(gid)
            out.d_tk.append(key)
            out.d_ev.append(-1 if value is None else value)
        out.new_entries.append(StateGroupEntry(gid, planned.prev_group, delta))

    def _verify(
        self, entries: Sequence[StateGroupEntry], new_entries: Sequence[StateGroupEntry], chunk_ids: set
    ) -> list:
        """Verify what will be written: the groups outside the chunk that either
        side builds on enter as snapshots of their (unchanging) full state."""
        outside = {e.prev_group for e in entries if e.prev_group is not None and e.prev_group not in chunk_ids}
        outside |= {e.prev_group for e in new_entries if e.prev_group is not None and e.prev_group not in chunk_ids}
        snapshots = []
        for gid in sorted(outside):
            state = self._known_state(gid)
            if state is not None:
                snapshots.append(StateGroupEntry(gid, None, state))
        return verify(snapshots + list(entries), snapshots + list(new_entries))

    def _carry(self, entries: Sequence[StateGroupEntry], local_depth: Mapping[int, int]) -> None:
        """Keep the states and depths of the groups the compactor carries on."""
        carried = self.compactor.carried_groups
        by_id = {e.group_id: e for e in entries}
        depth = {}
        for gid in carried:
            d = local_depth.get(gid, self._depth.get(gid))
            if d is not None:
                depth[gid] = d
        if not carried:
            self._bank.replace(None, {}, {})
            self._depth = depth
            return

        def state_of(gid: int) -> dict[int, int]:
            # Walk the original predecessors back to something known, then
            # apply the deltas forward.
            path = []
            cur: int | None = gid
            base: dict[int, int] | None = None
            while cur is not None:
                if cur in by_id:
                    path.append(by_id[cur])
                    cur = by_id[cur].prev_group
                    continue
                base = self._known_state(cur)
                if base is None:
                    raise ChunkError(f"state group {gid}: state of carried group's ancestor {cur} unknown")
                break
            state = base if base is not None else {}
            for entry in reversed(path):
                apply_delta(state, entry.delta)
            return state

        newest = max(carried)
        base = state_of(newest)
        diffs = {}
        for gid in carried:
            if gid != newest:
                diffs[gid] = state_diff(state_of(gid), base)
        self._bank.replace(newest, base, diffs)
        self._depth = depth


def iter_chunks(batches: Iterable[Any], starts: Sequence[int] = ()) -> Iterator[dict[str, np.ndarray]]:
    """Regroup a room's Arrow batches (sorted by ``sort_id``) into one dict of
    arrays per chunk; ``starts`` are the first groups of chunks 1, 2, ..."""
    starts_arr = np.asarray(sorted(starts), dtype=np.int64)

    pending: list[dict[str, np.ndarray]] = []
    current: int | None = None
    for batch in batches:
        arrays = {
            name: pc.fill_null(batch.column(name), -1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            for name in INPUT_COLUMNS
        }
        if len(arrays["sort_id"]) == 0:
            continue
        chunk = np.searchsorted(starts_arr, arrays["sort_id"], side="right")
        cuts = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        edges = [0] + cuts.tolist() + [len(chunk)]
        for a, z in itertools.pairwise(edges):
            c = int(chunk[a])
            if current is not None and c != current:
                if c < current:
                    raise ChunkError("chunks arrived out of order")
                yield _concat(pending)
                pending = []
            current = c
            pending.append({name: arr[a:z] for name, arr in arrays.items()})
    if pending:
        yield _concat(pending)


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _detail(result_missing: Mapping[int, int], mismatched: Sequence[int]) -> str:
    parts = []
    if mismatched:
        shown = ", ".join(str(g) for g in mismatched[:20])
        parts.append(f"verification failed for {len(mismatched)} group(s): {shown}")
    if result_missing:
        items = sorted(result_missing.items())[:5]
        shown = ", ".join(f"{g} (reaches missing {m})" for g, m in items)
        parts.append(f"{len(result_missing)} group(s) left as they are, their chain reaches a missing group: {shown}")
    return "; ".join(parts)


def _result_row(room_nid: int, r: ChunkResult, is_last: bool) -> dict[str, Any]:
    return {
        "room_nid": room_nid,
        "first_group": r.first_group,
        "last_group": r.last_group,
        "is_last": is_last,
        "status": "ok",
        "detail": _detail(r.missing, r.mismatched),
        "state_groups": r.state_groups,
        "rows_before": r.rows_before,
        "rows_after": r.rows_after,
        "rewritten": r.rewritten,
        "chain_updates": r.chain_updates,
        "missing": len(r.missing),
        "mismatched": len(r.mismatched),
        "max_depth": r.max_depth,
        "boundary": r.boundary,
        "groups_blob": r.groups.astype("<i8").tobytes(),
        "refs_blob": r.refs.astype("<i8").tobytes(),
        "deltas_blob": r.deltas.astype("<i8").tobytes(),
    }


def _error_row(room_nid: int, detail: str) -> dict[str, Any]:
    row: dict[str, Any] = {name: 0 for name in _OUTPUT_FIELDS}
    row.update(
        room_nid=room_nid,
        first_group=-1,
        last_group=-1,
        is_last=True,
        status="error",
        detail=detail,
        groups_blob=b"",
        refs_blob=b"",
        deltas_blob=b"",
    )
    return row


def _batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=_ARROW_OUTPUT)


def room_rows(
    room_nid: int,
    results: Iterator[ChunkResult],
    batches: Iterator[pa.RecordBatch],
    row: Callable[[int, ChunkResult, bool], dict[str, Any]],
) -> Iterator[pa.RecordBatch]:
    """The output of one room, for both layouts: ``row(room_nid, result,
    is_last)`` of each chunk's result, one held back so that the room's last
    row says so; when ``results`` raises, the room's input (``batches``) is
    drained (the worker expects the group consumed) and a final error row
    ends the room."""
    held: ChunkResult | None = None
    try:
        for result in results:
            if held is not None:
                yield _batch([row(room_nid, held, False)])
            held = result
    except Exception as exc:
        for _ in batches:  # drain: the worker expects the group consumed
            pass
        detail = f"{type(exc).__name__}: {exc}"
        tb = traceback.format_exc(limit=3).strip().splitlines()
        yield _batch([_error_row(room_nid, detail + " | " + " / ".join(tb[-3:]))])
        return
    if held is not None:
        yield _batch([row(room_nid, held, True)])


def whole_rooms(room_function: Callable) -> Callable:
    """A ``mapInArrow`` function over partitions that hold whole rooms, each
    room's rows together and sorted (the layout's ordered read): runs
    ``room_function`` (the ``applyInArrow`` form: ``(key, batches)``) on
    each room in turn, streaming, as ``groupBy(room).applyInArrow`` would
    after a shuffle. A room whose rows come in two runs stops the task
    (the read was not ordered: nothing of it is written)."""

    def slices(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[int, pa.RecordBatch]]:
        for batch in batches:
            n = batch.num_rows
            if not n:
                continue
            nids = batch.column("room_nid").to_numpy(zero_copy_only=False)
            edges = [0] + (np.flatnonzero(nids[1:] != nids[:-1]) + 1).tolist() + [n]
            for a, z in itertools.pairwise(edges):
                yield int(nids[a]), batch.slice(a, z - a)

    def per_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        seen = set()
        for nid, room in itertools.groupby(slices(batches), key=lambda item: item[0]):
            if nid in seen:
                raise ChunkError(f"room_nid {nid}: its rows arrived in two runs (the read was not ordered by room)")
            seen.add(nid)
            yield from room_function((pa.scalar(nid, pa.int64()),), (batch for _, batch in room))

    return per_partition


def make_room_function(config: Mapping[str, Any]):
    """The grouped-map function for ``applyInArrow`` (iterator form).

    ``config``: strategy, levels, max_hops, window, emit, fault_room (a
    room_nid or None), starts (room_nid -> chunk start groups, for rooms
    with more than one chunk). Yields one row per chunk; the room's last row has
    ``is_last``; a room that fails yields a final ``status='error'`` row.
    """
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
        )
        starts = cfg.get("starts", {}).get(room_nid, ())
        yield from room_rows(
            room_nid, (compactor.process_chunk(arrays) for arrays in iter_chunks(batches, starts)), batches, _result_row
        )

    return compact_room
