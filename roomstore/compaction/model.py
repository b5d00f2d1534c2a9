"""Value types shared by the state-group compaction code.

A *state group* is stored as an optional predecessor plus a delta against it.
Keys are interned ``(type, state_key)`` ids and values are event ids; a value
of ``None`` in a delta is a tombstone: the key is absent from this group even
though the predecessor has it. A group without a predecessor stores its full
state as its delta (tombstones there are no-ops).

These classes are plain, picklable attrs classes so that the Spark job can ship
them between workers. The ``delta`` dicts are shared, not copied: treat them as
read-only once built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

__all__ = [
    "Delta",
    "StateGroupEntry",
    "PlanEntry",
    "CompactionPlan",
    "StateResolutionError",
    "MissingPredecessorError",
    "PredecessorCycleError",
    "GroupsInput",
    "as_entries",
    "count_rows",
]

#: key id -> event id, or ``None`` for "removed relative to the predecessor".
Delta = Mapping[int, int | None]


@attrs.frozen(hash=False)
class StateGroupEntry:
    """One stored state group, as read from the database (the input form).

    ``prev_group`` is ``None`` for a full snapshot; ``delta`` maps key ids to
    event ids, ``None`` meaning the key is removed relative to ``prev_group``.
    Unhashable on purpose: it holds a dict.
    """

    group_id: int
    prev_group: int | None
    delta: Delta


@attrs.frozen(hash=False)
class PlanEntry:
    """How one state group should be stored after compaction (the output form).

    ``prev_group``/``delta`` are the new predecessor and the delta against it.
    ``changed`` is ``False`` when they equal what is stored today, so writers
    can skip the row. Applying ``delta`` to the full state of ``prev_group``
    yields exactly the group's original full state.
    """

    group_id: int
    prev_group: int | None
    delta: Delta
    changed: bool

    def as_input(self) -> StateGroupEntry:
        """This entry as a :class:`StateGroupEntry`, e.g. to verify or recompress."""
        return StateGroupEntry(self.group_id, self.prev_group, self.delta)


@attrs.frozen(hash=False)
class CompactionPlan:
    """The rewrite of a batch of state groups: one room, or one chunk of it.

    Attributes:
        strategy: ``"levels"`` or ``"smart"``.
        entries: one :class:`PlanEntry` per input group, in ascending id order,
            including unchanged and unresolvable groups.
        missing: groups whose original full state could not be computed (their
            predecessor chain reaches a purged group), mapped to the first
            absent ancestor (in chunked runs: the first ancestor that could
            not be looked up). They are kept unchanged in ``entries``.
        rows_before: delta rows stored today for these groups.
        rows_after: delta rows once ``entries`` are applied.
        max_depth: the longest predecessor chain (in hops) among the resolved
            groups of this batch under the new plan; groups in ``missing`` keep
            their old, unknown depth.
    """

    strategy: str
    entries: tuple[PlanEntry, ...]
    missing: Mapping[int, int]
    rows_before: int
    rows_after: int
    max_depth: int

    @property
    def saving(self) -> int:
        """Rows saved by applying this plan (negative if it would grow)."""
        return self.rows_before - self.rows_after

    @property
    def changed_entries(self) -> tuple[PlanEntry, ...]:
        """Only the entries that differ from what is stored (what to write)."""
        return tuple(e for e in self.entries if e.changed)

    def as_groups(self) -> tuple[StateGroupEntry, ...]:
        """The groups as they will be stored once the plan is applied."""
        return tuple(e.as_input() for e in self.entries)


class StateResolutionError(ValueError):
    """A group's full state cannot be computed from the given groups."""


class MissingPredecessorError(StateResolutionError):
    """A predecessor chain reaches a group that is not present (e.g. purged)."""

    def __init__(self, group_id: int, missing_group: int) -> None:
        super().__init__(
            f"state group {group_id}: predecessor chain reaches state group "
            f"{missing_group}, which is not present (purged or outside the input)"
        )
        self.group_id = group_id
        self.missing_group = missing_group


class PredecessorCycleError(StateResolutionError):
    """Predecessor links loop back on themselves, so no full state exists."""

    def __init__(self, cycle: Iterable[int]) -> None:
        self.cycle = tuple(cycle)
        super().__init__("state group predecessor cycle: " + " -> ".join(str(g) for g in self.cycle))


#: What the public functions accept as "groups": entries, or plain
#: ``(group_id, prev_group, delta)`` tuples (e.g. straight from a DB cursor).
GroupsInput = Iterable[StateGroupEntry | PlanEntry | tuple[int, int | None, Delta]]


def as_entries(groups: GroupsInput) -> list[StateGroupEntry]:
    """Normalise ``groups`` to a list of :class:`StateGroupEntry`.

    Accepts entries, plan entries or ``(group_id, prev_group, delta)`` tuples.
    Order is preserved; duplicate group ids raise ``ValueError``.
    """
    out: list[StateGroupEntry] = []
    seen: set[int] = set()
    for g in groups:
        if isinstance(g, StateGroupEntry):
            entry = g
        elif isinstance(g, PlanEntry):
            entry = g.as_input()
        else:
            group_id, prev_group, delta = g
            entry = StateGroupEntry(group_id, prev_group, delta)
        if entry.group_id in seen:
            raise ValueError(f"state group {entry.group_id} appears twice")
        seen.add(entry.group_id)
        out.append(entry)
    return out


def count_rows(groups: GroupsInput) -> int:
    """Number of stored delta rows: the delta sizes summed over ``groups``.

    Tombstones count: each is a row in ``state_groups_state``.
    """
    total = 0
    for g in groups:
        total += len(g.delta if isinstance(g, (StateGroupEntry, PlanEntry)) else g[2])
    return total
