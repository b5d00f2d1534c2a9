"""State-group compaction: choose new predecessors so the delta tables shrink.

Persist-time writes chain every group to the one before it and take a full
snapshot every 100 hops, so most rows are snapshots. Compaction rewrites each
group as a delta against a better predecessor while keeping every group's full
state exactly as it was and every predecessor chain short.

Two strategies, both walking a room's groups in ascending id order:

``levels``
    The scheme of matrix-org's rust-synapse-compress-state. Level ``i`` holds a
    chain of at most ``levels[i]`` groups. A new group hangs off the head of
    the lowest level that has room; every full level below it restarts at the
    new group; if all are full the group becomes a snapshot. Chains are at
    most ``sum(size - 1 for size in levels)`` hops long (172 for the default
    ``(100, 50, 25)``).

``smart``
    Runs the same levels bookkeeping as a skeleton, then, for each group,
    picks among a window of recent groups, the level heads, the last few past
    heads of the upper levels (``retired``) and "no predecessor" the base
    giving the smallest delta, within a depth budget:
    the group's chain plus everything the skeleton may still hang below it
    (its *reach*) must fit in ``max_hops``. A skeleton parent's reach exceeds
    its child's, so ``depth + reach <= max_hops`` holds for every group by
    induction and the levels choice is always within budget when
    ``max_hops >= levels_hop_bound(levels)``: smart is then never worse than
    levels, per group and so in total, and never exceeds ``max_hops``. It wins
    where id order and history disagree: forks, interleaved branches,
    backfill, keys that flip back.

Both run in :class:`StreamingCompactor`, which sees a room in id-ordered
chunks and carries only bounded state between them (see its docstring for the
contract). The one-shot helpers feed it the whole room as one chunk.

How the state is tracked cheaply: the compactor keeps the full state of one
group, the *anchor* (the last group processed), and for every other group it
may still need (the *pool*) only its difference from the anchor. When the
anchor advances by a change set ``C``, each pool diff is updated on the keys of
``C`` only, so a step costs ``O(|pool| * |C|)`` and the size of a candidate's
delta is simply ``len(diff)``, with no full-state comparisons. A group whose
original predecessor is in the pool gets its change set from that
predecessor's diff plus its own delta.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs

from roomstore.compaction.model import (
    CompactionPlan,
    GroupsInput,
    PlanEntry,
    PredecessorCycleError,
    StateGroupEntry,
    as_entries,
    count_rows,
)
from roomstore.compaction.states import (
    PartialStates,
    apply_delta,
    chain_depths,
    full_states,
    full_states_partial,
    max_hops,
    verify,
)

__all__ = [
    "DEFAULT_LEVELS",
    "DEFAULT_RETIRED",
    "DEFAULT_WINDOW",
    "STRATEGIES",
    "CompactionPlan",
    "PartialStates",
    "PlanEntry",
    "RoomCompaction",
    "StateGroupEntry",
    "StateResolver",
    "StreamingCompactor",
    "chain_depths",
    "compress_chunks",
    "compress_levels",
    "compress_room",
    "compress_smart",
    "count_rows",
    "full_states",
    "full_states_partial",
    "levels_hop_bound",
    "max_hops",
    "verify",
]

#: The level sizes rust-synapse-compress-state uses by default.
DEFAULT_LEVELS: tuple[int, ...] = (100, 50, 25)
#: How many recent groups smart considers as bases (the pool also always holds
#: the level heads). Per-group cost is linear in it.
DEFAULT_WINDOW = 32
#: How many past heads of each level above the first the compactor keeps as
#: extra bases (see ``retired`` of :class:`StreamingCompactor`).
DEFAULT_RETIRED = 2
#: Strategies a :class:`StreamingCompactor` runs; ``compress_room`` adds "auto".
STRATEGIES = ("levels", "smart")

#: ``resolve_state(group_id)`` returns the *original* full state of a group
#: the compactor no longer holds, or ``None`` if it is unknown (purged).
StateResolver = Callable[[int], Mapping[int, int] | None]


def levels_hop_bound(levels: Sequence[int]) -> int:
    """The longest chain, in hops, the levels scheme can build with ``levels``.

    Each level contributes at most ``size - 1`` hops: ``(100, 50, 25)`` -> 172.
    """
    return sum(size - 1 for size in levels)


class _Levels:
    """The levels bookkeeping: which head each new group hangs off."""

    __slots__ = ("sizes", "lengths", "heads")

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or any(int(s) < 1 for s in sizes):
            raise ValueError(f"levels must be positive chain lengths, got {sizes!r}")
        self.sizes = tuple(int(s) for s in sizes)
        self.lengths = [0] * len(self.sizes)
        self.heads: list[int | None] = [None] * len(self.sizes)

    def place(self, group_id: int) -> tuple[int | None, int, list[int]]:
        """Append ``group_id``.

        Returns its levels predecessor, its *reach* (how many more hops the
        scheme can still hang below it, at most) and the heads it replaced.
        A group entering level ``i`` at position ``n`` can grow that chain by
        ``sizes[i] - n`` more groups and, below each, full chains on every
        lower level: reach = ``sizes[i] - n + sum(sizes[j] - 1 for j < i)``.
        """
        replaced: list[int] = []
        below = 0  # sum(sizes[j] - 1) over the full levels passed so far
        for i, size in enumerate(self.sizes):
            old = self.heads[i]
            if old is not None:
                replaced.append(old)
            self.heads[i] = group_id
            if self.lengths[i] < size:
                self.lengths[i] += 1
                return old, size - self.lengths[i] + below, replaced
            # Level full: restart its chain at this group and try the next one up.
            self.lengths[i] = 1
            below += size - 1
        return None, below, replaced


class StreamingCompactor:
    """Compacts one room's state groups, fed in ascending-id chunks.

    Contract:

    * Call :meth:`feed` with the room's groups in strictly ascending id order,
      split into chunks of any size. Every group of the room you want
      compacted must be fed exactly once; one compactor per room.
    * Between chunks the compactor keeps: the full state of the last group
      processed, the diff against it of at most ``window`` recent groups plus
      the ``len(levels)`` level heads and ``retired * (len(levels) - 1)`` past
      heads, and a few integers per such group.
      Memory is therefore ``O(chunk + state size + (window + levels * (1 + retired)) * diff)``,
      never proportional to the room.
    * A group's *original* predecessor must be available to compute its full
      state. It is looked up in the carried groups, then in the current chunk,
      then through ``resolve_state`` (e.g. a database read). If all fail, the
      group is reported in the plan's ``missing`` (with the absent ancestor),
      left unchanged, and is not used as a base; groups depending on it fare
      the same. The plan stays correct either way.
    * The union of the chunk plans is the room's plan. It is identical to the
      one-shot plan (one chunk with everything) whenever every original
      predecessor can be resolved.
    * Each plan entry preserves its group's full state whatever subset of
      entries is applied, but the hop bound holds only once *all* changed
      entries of the room are applied. Decide with :meth:`should_apply` after
      the last chunk, then apply all changed entries or none.

    Args:
        strategy: ``"levels"`` or ``"smart"``.
        levels: level sizes of the levels scheme (smart's skeleton).
        max_hops: longest chain allowed; defaults to (and for ``levels`` may
            not be below) ``levels_hop_bound(levels)``. Smart may use any depth
            within it that the skeleton leaves free, including slack above
            the bound, to find smaller deltas.
        window: number of recent groups kept as bases / for resolving
            original predecessors across chunk boundaries (at least 1).
        resolve_state: fallback lookup of original full states, see above.
        allow_removals: False for layouts whose deltas cannot remove a key
            (Synapse's): a group is never hung off a base holding a key the
            group lacks (it becomes a snapshot rather), so no delta of the
            plan holds a ``None``.
        retired: past heads kept per level above the first (0: none). Where
            the levels base holds a key the group lacks and removals are not
            allowed, the scheme's own fallback is the base's predecessor, then
            its predecessor, ...: older heads of the upper levels. Keeping the
            last few in the pool lets such a group hang off one of them (a
            delta of about a level's worth of changes) instead of becoming a
            snapshot (the whole state). On Synapse-shaped federated rooms
            (forks every ~20 groups) this took the rows after from 1.14x to
            0.87x of synapse_auto_compressor's; 1 and 4 gave the same rows as 2.
    """

    def __init__(
        self,
        strategy: str = "smart",
        *,
        levels: Sequence[int] = DEFAULT_LEVELS,
        max_hops: int | None = None,
        window: int = DEFAULT_WINDOW,
        resolve_state: StateResolver | None = None,
        allow_removals: bool = True,
        retired: int = DEFAULT_RETIRED,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if window < 1:
            raise ValueError("window must be at least 1")
        self.strategy = strategy
        self._levels = _Levels(levels)
        bound = levels_hop_bound(self._levels.sizes)
        if max_hops is None:
            max_hops = bound
        if max_hops < 0:
            raise ValueError("max_hops must not be negative")
        if strategy == "levels" and max_hops < bound:
            raise ValueError(
                f"levels {self._levels.sizes} build chains of up to {bound} hops, more than max_hops={max_hops}"
            )
        self.max_hops = max_hops
        self._window = window
        self._resolve_state = resolve_state
        self._allow_removals = allow_removals

        # The anchor: full state of the last group processed (or empty).
        self._anchor: dict[int, int] = {}
        # The pool: group id -> {key: that group's value, None if absent} on
        # exactly the keys where it differs from the anchor.
        self._diffs: dict[int, dict[int, int | None]] = {}
        self._depth: dict[int, int] = {}  # chain length under the new plan
        # Per pool member: how many keys it holds that the anchor lacks (a
        # delta against it would have to remove them), kept up to date by
        # _advance_anchor so the check costs nothing per candidate.
        self._absent: dict[int, int] = {}
        self._recent: deque[int] = deque()
        # Past heads of the upper levels (1..): the bases the levels chain
        # walks back through; kept so a group whose levels base needs a
        # removal can fall back to one of them rather than a snapshot.
        self._retired: list[deque[int]] = [deque() for _ in self._levels.sizes[1:]]
        self._retire = retired
        self._last_id: int | None = None

        # Per-chunk lookups, dropped at the end of each feed().
        self._chunk: dict[int, StateGroupEntry] = {}
        self._unresolved: dict[int, int] = {}

        self.rows_before = 0
        self.rows_after = 0
        self.max_depth = 0
        self.missing_count = 0

    # -- public -----------------------------------------------------------

    @property
    def carried_groups(self) -> tuple[int, ...]:
        """Ids of the groups whose diffs are held between chunks (bounded)."""
        return tuple(sorted(self._diffs))

    @property
    def saving(self) -> int:
        """Rows saved so far if every plan fed out is applied."""
        return self.rows_before - self.rows_after

    def should_apply(self, min_saving: int = 1) -> bool:
        """Whether the room's plan (all chunks so far) saves ``min_saving`` rows."""
        return self.saving >= min_saving

    def feed(self, chunk: GroupsInput) -> CompactionPlan:
        """Compact the next chunk of groups; returns the plan for this chunk.

        Raises ``ValueError`` if ids are not strictly ascending across all the
        chunks fed so far (nothing is consumed then), and
        :class:`PredecessorCycleError` on cycles (the compactor is unusable
        afterwards: drop the room).
        """
        entries = as_entries(chunk)
        last = self._last_id
        for entry in entries:
            if last is not None and entry.group_id <= last:
                raise ValueError(f"state groups must be fed in ascending id order: {entry.group_id} after {last}")
            last = entry.group_id
        self._last_id = last
        self._chunk = {e.group_id: e for e in entries}
        self._unresolved = {}
        out: list[PlanEntry] = []
        missing: dict[int, int] = {}
        rows_before = rows_after = 0
        chunk_depth = 0
        try:
            for entry in entries:
                planned, depth = self._process(entry, missing)
                out.append(planned)
                rows_before += len(entry.delta)
                rows_after += len(planned.delta)
                chunk_depth = max(chunk_depth, depth)
        finally:
            self._chunk = {}
            self._unresolved = {}
        self.rows_before += rows_before
        self.rows_after += rows_after
        self.max_depth = max(self.max_depth, chunk_depth)
        self.missing_count += len(missing)
        return CompactionPlan(
            strategy=self.strategy,
            entries=tuple(out),
            missing=missing,
            rows_before=rows_before,
            rows_after=rows_after,
            max_depth=chunk_depth,
        )

    # -- internals ----------------------------------------------------------

    def _process(self, entry: StateGroupEntry, missing: dict[int, int]) -> tuple[PlanEntry, int]:
        """Plan one group; returns its entry and its new depth (0 if unknown)."""
        group_id = entry.group_id
        changes = self._changes_from_anchor(entry, missing)
        if changes is None:
            # Unknown state: keep the row as it is and never build on it.
            return PlanEntry(group_id, entry.prev_group, entry.delta, False), 0

        levels_prev, reach, replaced = self._levels.place(group_id)
        self._advance_anchor(group_id, changes)

        if self.strategy == "levels":
            new_prev = levels_prev
            if new_prev is not None and not self._allow_removals and self._absent[new_prev]:
                # The levels base would need a removal: the best base that
                # needs none, within the same depth budget as smart's.
                new_prev = self._best_base(group_id, entry.prev_group, self.max_hops - reach)
        else:
            # Leave room for everything the skeleton may still hang below this
            # group; that keeps the levels choice legal for every later group.
            budget = self.max_hops - reach
            new_prev = self._best_base(group_id, entry.prev_group, budget)

        if new_prev is None:
            delta: dict[int, int | None] = dict(self._anchor)
            depth = 0
        else:
            anchor = self._anchor
            delta = {key: anchor.get(key) for key in self._diffs[new_prev]}
            depth = self._depth[new_prev] + 1
        self._depth[group_id] = depth

        self._recent.append(group_id)
        self._evict(replaced)

        if new_prev == entry.prev_group and delta == entry.delta:
            return PlanEntry(group_id, entry.prev_group, entry.delta, False), depth
        return PlanEntry(group_id, new_prev, delta, True), depth

    def _best_base(
        self,
        group_id: int,
        orig_prev: int | None,
        budget: int,
    ) -> int | None:
        """Smart's choice: the base with depth < ``budget`` giving the smallest delta.

        Ties prefer keeping the stored predecessor (no write), then the
        shallowest base (leaves room for later groups), then the most recent.
        The levels choice is always in the pool and, with
        ``max_hops >= levels_hop_bound``, always within budget (see the module
        docstring), so the result is never a bigger delta than it.
        """
        # Sort keys: (delta rows, rewrites?, depth, -recency). A snapshot has
        # depth "-1": at equal cost it is the best foundation.
        best: int | None = None
        best_key = (len(self._anchor), orig_prev is not None, -1, 0)
        depth = self._depth
        absent = None if self._allow_removals else self._absent
        for cand, diff in self._diffs.items():
            if cand == group_id:
                continue
            cand_depth = depth[cand]
            if cand_depth >= budget:
                continue
            key = (len(diff), cand != orig_prev, cand_depth, -cand)
            # A base holding a key the group lacks would need a removal.
            if key < best_key and (absent is None or not absent[cand]):
                best, best_key = cand, key
        return best

    def _advance_anchor(self, group_id: int, changes: dict[int, int | None]) -> None:
        """Make ``group_id`` (= anchor + ``changes``) the new anchor."""
        anchor = self._anchor
        if changes:
            # (key, new value, old value, the anchor lacked the key, now lacks it)
            steps = [(key, new, anchor.get(key), key not in anchor, new is None) for key, new in changes.items()]
            absent = self._absent
            for cand, diff in self._diffs.items():
                count = absent[cand]
                for key, new, old, was_absent, now_absent in steps:
                    if key in diff:
                        # The member already differed here; it may now agree.
                        if diff[key] == new:
                            del diff[key]
                            count -= was_absent
                        else:
                            count += now_absent - was_absent
                    else:
                        # It agreed with the old anchor, so now it differs.
                        diff[key] = old
                        count += now_absent and not was_absent
                absent[cand] = count
            apply_delta(anchor, changes)
        self._diffs[group_id] = {}
        self._absent[group_id] = 0

    def _evict(self, replaced: Sequence[int]) -> None:
        """Drop groups that are neither recent, a level head nor a kept past head."""
        heads = self._levels.heads
        dropped: list[int] = []
        if self._retire:
            for level, old in enumerate(replaced[1:]):
                kept = self._retired[level]
                if not kept or kept[-1] != old:
                    kept.append(old)
                    if len(kept) > self._retire:
                        dropped.append(kept.popleft())
        else:
            dropped.extend(replaced)
        while len(self._recent) > self._window:
            dropped.append(self._recent.popleft())
        if replaced and self._retire:
            dropped.append(replaced[0])
        if not dropped:
            return
        keep = set(heads)
        keep.update(self._recent)
        for kept in self._retired:
            keep.update(kept)
        for old in dropped:
            if old not in keep:
                self._forget(old)

    def _forget(self, group_id: int) -> None:
        if self._diffs.pop(group_id, None) is not None:
            del self._depth[group_id]
            del self._absent[group_id]

    def _changes_from_anchor(self, entry: StateGroupEntry, missing: dict[int, int]) -> dict[int, int | None] | None:
        """The keys (and new values, ``None`` = absent) where ``entry``'s full
        state differs from the anchor's; ``None`` if its state is unknowable.
        """
        anchor = self._anchor
        prev = entry.prev_group
        if prev is not None and prev in self._diffs:
            # Fast path (the usual case): the stored predecessor is held, so the
            # group differs from the anchor only on its diff and its own delta.
            state_here = dict(self._diffs[prev])
            state_here.update(entry.delta)
            return {k: v for k, v in state_here.items() if anchor.get(k) != v}

        # Walk back through this chunk's raw rows to something we know.
        path = [entry]
        seen: set[int] = {entry.group_id}
        overlay: dict[int, int | None] | None = None
        full: dict[int, int] | None = None
        cur = prev
        while True:
            if cur is None:
                full = {}
                break
            if cur in self._diffs:
                overlay = dict(self._diffs[cur])
                break
            blocked_by = self._unresolved.get(cur)
            if blocked_by is None:
                raw = self._chunk.get(cur)
                if raw is not None:
                    if cur in seen:
                        ids = [e.group_id for e in path]
                        raise PredecessorCycleError(ids[ids.index(cur) :] + [cur])
                    seen.add(cur)
                    path.append(raw)
                    cur = raw.prev_group
                    continue
                fetched = self._resolve_state(cur) if self._resolve_state else None
                if fetched is not None:
                    full = dict(fetched)
                    break
                blocked_by = cur
            for node in path:
                self._unresolved[node.group_id] = blocked_by
            missing[entry.group_id] = blocked_by
            return None

        if overlay is not None:
            for node in reversed(path):
                overlay.update(node.delta)
            return {k: v for k, v in overlay.items() if anchor.get(k) != v}
        assert full is not None
        for node in reversed(path):
            apply_delta(full, node.delta)
        changes: dict[int, int | None] = {k: v for k, v in full.items() if anchor.get(k) != v}
        for key in anchor:
            if key not in full:
                changes[key] = None
        return changes


# -- one-shot helpers --------------------------------------------------------


def _sorted_entries(groups: GroupsInput) -> list[StateGroupEntry]:
    return sorted(as_entries(groups), key=lambda e: e.group_id)


def compress_levels(
    groups: GroupsInput,
    levels: Sequence[int] = DEFAULT_LEVELS,
    *,
    window: int = DEFAULT_WINDOW,
) -> CompactionPlan:
    """Plan a room with the levels scheme (see module docstring).

    ``groups`` are one room's groups in any order; they are processed in id
    order. Each group gets the predecessor the levels pick and a delta against
    it (tombstones where the predecessor has keys the group lacks). Groups
    whose chain reaches an absent group are reported in ``missing`` and kept
    unchanged. ``window`` only affects speed (recent groups held for resolving
    forks), never the plan.
    """
    return StreamingCompactor("levels", levels=levels, window=window).feed(_sorted_entries(groups))


def compress_smart(
    groups: GroupsInput,
    max_hops: int | None = None,
    window: int = DEFAULT_WINDOW,
    *,
    levels: Sequence[int] = DEFAULT_LEVELS,
) -> CompactionPlan:
    """Plan a room picking, per group, the base giving the smallest delta.

    Candidates are the ``window`` most recent groups, the heads of the levels
    skeleton (so the levels choice is always among them) and "no predecessor".
    A candidate is legal if the group's chain stays within the depth the
    skeleton gives it plus ``max_hops - levels_hop_bound(levels)`` slack, and
    never beyond ``max_hops`` (default: the levels bound). With
    ``max_hops >= levels_hop_bound(levels)`` the plan never has more rows than
    :func:`compress_levels` with the same levels, for any group.
    """
    return StreamingCompactor("smart", levels=levels, max_hops=max_hops, window=window).feed(_sorted_entries(groups))


def compress_chunks(
    chunks: Iterable[GroupsInput],
    strategy: str = "smart",
    *,
    levels: Sequence[int] = DEFAULT_LEVELS,
    max_hops: int | None = None,
    window: int = DEFAULT_WINDOW,
    resolve_state: StateResolver | None = None,
) -> Iterator[CompactionPlan]:
    """Compact one room given as ascending-id chunks; yields one plan per chunk.

    A thin generator over :class:`StreamingCompactor` (whose docstring has the
    memory and correctness contract). ``strategy="auto"`` means ``"smart"``
    here: picking the better plan afterwards would need the whole room.
    """
    compactor = StreamingCompactor(
        "smart" if strategy == "auto" else strategy,
        levels=levels,
        max_hops=max_hops,
        window=window,
        resolve_state=resolve_state,
    )
    for chunk in chunks:
        yield compactor.feed(chunk)


@attrs.frozen(hash=False)
class RoomCompaction:
    """Outcome of :func:`compress_room`.

    Attributes:
        action: ``"rewrite"`` to apply ``plan``, ``"skip"`` to leave the room
            as it is (too small a saving, or nothing to change).
        strategy: the strategy that produced ``plan``.
        plan: the best plan found (kept even when skipping, for reporting).
        rows_before: delta rows stored today.
        rows_after: delta rows after applying ``plan``.
        max_hops: longest chain under ``plan`` (resolved groups).
    """

    action: str
    strategy: str
    plan: CompactionPlan
    rows_before: int
    rows_after: int
    max_hops: int

    @property
    def saving(self) -> int:
        return self.rows_before - self.rows_after

    @property
    def writes(self) -> tuple[PlanEntry, ...]:
        """Entries to write: the changed ones, or none when skipping."""
        return () if self.action == "skip" else self.plan.changed_entries


def compress_room(
    groups: GroupsInput,
    strategy: str = "auto",
    *,
    levels: Sequence[int] = DEFAULT_LEVELS,
    max_hops: int | None = None,
    window: int = DEFAULT_WINDOW,
    min_saving: int = 1,
) -> RoomCompaction:
    """Plan one room and decide whether the rewrite is worth applying.

    ``strategy`` is ``"levels"``, ``"smart"`` or ``"auto"`` (run both and keep
    the plan with fewer rows, then fewer writes, among those within
    ``max_hops``; ties go to ``levels``). ``max_hops`` defaults to
    ``levels_hop_bound(levels)``. The result's action is ``"skip"`` when the
    plan saves fewer than ``min_saving`` rows or changes nothing, so with
    ``min_saving=0`` applying a ``"rewrite"`` never increases the row count.
    Raises ``ValueError`` for ``strategy="levels"`` if ``max_hops`` is below
    the levels' own bound.
    """
    if strategy not in STRATEGIES + ("auto",):
        raise ValueError(f"unknown strategy {strategy!r}")
    entries = _sorted_entries(groups)
    limit = levels_hop_bound(levels) if max_hops is None else max_hops
    if strategy == "auto":
        names = [s for s in STRATEGIES if s != "levels" or levels_hop_bound(levels) <= limit]
    else:
        names = [strategy]
    plans = [StreamingCompactor(name, levels=levels, max_hops=limit, window=window).feed(entries) for name in names]
    plan = min(plans, key=lambda p: (p.rows_after, len(p.changed_entries)))
    worth_it = plan.saving >= min_saving and any(e.changed for e in plan.entries)
    return RoomCompaction(
        action="rewrite" if worth_it else "skip",
        strategy=plan.strategy,
        plan=plan,
        rows_before=plan.rows_before,
        rows_after=plan.rows_after,
        max_hops=plan.max_depth,
    )
