"""What the Spark side hands the writer: a chunk's new representation.

The contract between :mod:`roomstore.compaction.job.executor` (which plans a
chunk into a :class:`ChunkResult`), the layouts (which decode the executor's
output row back into one and turn it into a :class:`StagedChunk`) and
:mod:`roomstore.compaction.write_back` (which stages and swaps it). Both chunk
forms live here so a layout needs nothing of the executor's code.
:func:`row_checksum` (Python, numpy) and :data:`CHECKSUM_SQL` compute the
same per-row value, and a chunk's staged
groups carry the representation read (``old_prev``, ``old_rows``,
``old_checksum``) so the swap can detect any change. Imports nothing but
attrs and numpy: the executors load it from the ``--py-files`` zip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

# Per-row checksum of a delta row: small enough that a group's sum fits a
# signed 64-bit integer for any realistic group (a million rows), identical in
# Python (numpy int64) and SQL. It only has to catch accidental change (a
# group deleted and re-created, a concurrent rewrite), not an adversary.
_KEY_MOD = 1_000_003
_MUL = 1_000_033
_EVENT_MOD = 1_000_033

#: SQL for :func:`row_checksum` over ``state_group_deltas AS d``.
CHECKSUM_SQL = f"((CAST(d.type_key_nid AS BIGINT) % {_KEY_MOD}) * {_MUL} + COALESCE(d.event_nid, 0) % {_EVENT_MOD})"


def row_checksum(type_key_nid: int, event_nid: int | None) -> int:
    """The checksum of one delta row (``None`` event: a tombstone)."""
    return (type_key_nid % _KEY_MOD) * _MUL + (event_nid or 0) % _EVENT_MOD


def row_checksum_np(type_keys: Any, events: Any) -> Any:
    """:func:`row_checksum` over numpy int64 arrays; ``events`` uses -1 for NULL."""
    ev = np.where(events < 0, 0, events)
    return (type_keys % _KEY_MOD) * _MUL + ev % _EVENT_MOD


@attrs.frozen
class StagedChunk:
    """A chunk's new representation, ready to stage and swap.

    Attributes:
        room_nid: the room.
        first_group, last_group: the chunk's first and last group ids (the
            chunk is every group of the room between them, up to the run's
            ``snapshot_max``).
        groups: one tuple per group of the chunk: ``(state_group, old_prev,
            old_rows, old_checksum, new_prev, new_chain_length, rewrite)``;
            ``old_*`` is the representation read, ``rewrite`` 1 when the delta
            rows and predecessor are replaced (0: at most ``chain_length``
            changes). ``None`` predecessors are snapshots.
        refs: groups outside the chunk that a new predecessor chain passes
            through first (the new predecessors from earlier chunks); the swap
            requires them to still exist.
        deltas: ``(state_group, type_key_nid, event_nid)`` new rows of the
            rewritten groups, ``None`` event meaning "key removed".
        rows_before, rows_after, groups_rewritten: for the progress row.
    """

    room_nid: int
    first_group: int
    last_group: int
    groups: Sequence[tuple]
    refs: Sequence[int]
    deltas: Sequence[tuple]
    rows_before: int
    rows_after: int
    groups_rewritten: int


@attrs.define
class ChunkResult:
    """What :meth:`~roomstore.compaction.job.executor.RoomCompactor.process_chunk` found for one chunk.

    ``groups`` is an int64 array (n, 7): ``state_group, old_prev, old_rows,
    old_checksum, new_prev, new_chain_length, rewrite`` (-1 prev: snapshot);
    ``refs`` the groups outside the chunk that rewritten groups now hang off;
    ``deltas`` (m, 3): ``state_group, type_key_nid, event_nid`` (-1 event:
    tombstone) of the rewritten groups. ``mismatched`` lists groups whose full
    state would change (must be empty to write); ``missing`` maps groups
    whose chain reaches an absent group to that group (left unchanged).
    """

    first_group: int
    last_group: int
    state_groups: int
    rows_before: int
    rows_after: int
    rewritten: int
    chain_updates: int
    max_depth: int
    boundary: int
    missing: dict[int, int]
    mismatched: list[int]
    groups: np.ndarray
    refs: np.ndarray
    deltas: np.ndarray

    @property
    def has_changes(self) -> bool:
        return bool(self.rewritten or self.chain_updates)

    def to_staged(self, room_nid: int) -> StagedChunk:
        """The writer's form (Python ints, None for NULL)."""
        groups = [
            (g, None if op < 0 else op, rows, ck, None if np_ < 0 else np_, chain, rw)
            for g, op, rows, ck, np_, chain, rw in self.groups.tolist()
        ]
        deltas = [(g, k, None if e < 0 else e) for g, k, e in self.deltas.tolist()]
        return StagedChunk(
            room_nid=room_nid,
            first_group=self.first_group,
            last_group=self.last_group,
            groups=groups,
            refs=self.refs.tolist(),
            deltas=deltas,
            rows_before=self.rows_before,
            rows_after=self.rows_after,
            groups_rewritten=self.rewritten,
        )
