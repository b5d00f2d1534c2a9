"""What the Spark side hands the writer: a chunk's new representation.

The contract between :mod:`roomstore.compaction.job.executor` (which builds
:class:`StagedChunk` values) and :mod:`roomstore.compaction.writer` (which
stages and swaps them): :func:`row_checksum` (Python, numpy) and
:data:`CHECKSUM_SQL` compute the same per-row value, and a chunk's staged
groups carry the representation read (``old_prev``, ``old_rows``,
``old_checksum``) so the swap can detect any change. Imports nothing but
attrs and numpy: the executors load it from the ``--py-files`` zip.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

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
CHECKSUM_SQL = (
    f"((CAST(d.type_key_nid AS BIGINT) % {_KEY_MOD}) * {_MUL}"
    f" + COALESCE(d.event_nid, 0) % {_EVENT_MOD})"
)


def row_checksum(type_key_nid: int, event_nid: Optional[int]) -> int:
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
