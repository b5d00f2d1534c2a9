"""Full states, chain depths and plan verification for state-group forests.

Everything here is iterative (predecessor chains can be far longer than
Python's recursion limit) and independent of the compaction strategies, so
:func:`verify` is a genuine second opinion on a plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import attrs

from roomstore.compaction.model import (
    CompactionPlan,
    GroupsInput,
    MissingPredecessorError,
    PredecessorCycleError,
    StateGroupEntry,
    as_entries,
)
from roomstore.state.deltas import apply_delta, state_diff

__all__ = [
    "PartialStates",
    "apply_delta",
    "state_diff",
    "full_states",
    "full_states_partial",
    "chain_depths",
    "max_hops",
    "verify",
]

State = dict[int, int]


@attrs.frozen(hash=False)
class PartialStates:
    """Result of :func:`full_states_partial`.

    Attributes:
        states: full state of every group whose predecessor chain is complete.
        missing: every other group, mapped to the first absent ancestor its
            chain reaches (a purged group, or one outside the input).
    """

    states: dict[int, State]
    missing: dict[int, int]


def _index(groups: GroupsInput) -> dict[int, StateGroupEntry]:
    return {e.group_id: e for e in as_entries(groups)}


def _resolve_all(by_id: Mapping[int, StateGroupEntry], *, strict: bool) -> PartialStates:
    states: dict[int, State] = {}
    missing: dict[int, int] = {}
    for start in by_id:
        if start in states or start in missing:
            continue
        # Walk up to something already known (or a root), remembering the way.
        path: list[int] = []
        on_path: set[int] = set()
        cur: int | None = start
        base: State = {}
        blocked_by: int | None = None
        while cur is not None:
            if cur in states:
                base = states[cur]
                break
            if cur in missing:
                blocked_by = missing[cur]
                break
            entry = by_id.get(cur)
            if entry is None:
                blocked_by = cur
                break
            if cur in on_path:
                raise PredecessorCycleError(path[path.index(cur) :] + [cur])
            path.append(cur)
            on_path.add(cur)
            cur = entry.prev_group
        if blocked_by is not None:
            if strict:
                raise MissingPredecessorError(start, blocked_by)
            for node in path:
                missing[node] = blocked_by
            continue
        # Walk back down, one copy per group: each memo entry owns its dict.
        for node in reversed(path):
            base = apply_delta(dict(base), by_id[node].delta)
            states[node] = base
    return PartialStates(states=states, missing=missing)


def full_states(groups: GroupsInput) -> dict[int, State]:
    """Full state of every group: ``{group_id: {key: event_id}}``.

    Memoised, so each group costs one copy of its state plus its delta; this
    holds every state in memory, which is fine for tests and small rooms (use
    :class:`~roomstore.compaction.algorithm.StreamingCompactor` for big ones).

    Raises:
        MissingPredecessorError: a chain reaches a group not in ``groups``.
        PredecessorCycleError: predecessor links form a cycle.
    """
    return _resolve_all(_index(groups), strict=True).states


def full_states_partial(groups: GroupsInput) -> PartialStates:
    """Like :func:`full_states`, but report unresolvable groups instead of raising.

    Groups whose chain reaches an absent (e.g. purged) predecessor are listed in
    ``missing`` so the caller can skip them with a warning. Cycles still raise
    :class:`PredecessorCycleError`: they mean corrupt data, not purging.
    """
    return _resolve_all(_index(groups), strict=False)


def chain_depths(groups: GroupsInput) -> dict[int, int]:
    """Hops from each group to the end of its predecessor chain.

    A snapshot (no predecessor) has depth 0. A link to a group absent from
    ``groups`` counts as one final hop, so for a chunk of a room the result is
    a lower bound. Raises :class:`PredecessorCycleError` on cycles.
    """
    by_id = _index(groups)
    depth: dict[int, int] = {}
    for start in by_id:
        path: list[int] = []
        on_path: set[int] = set()
        cur: int | None = start
        base = -1  # depth of whatever lies above the top of `path`
        while cur is not None:
            if cur in depth:
                base = depth[cur]
                break
            entry = by_id.get(cur)
            if entry is None:
                base = 0  # the dangling group itself: one hop to reach it
                break
            if cur in on_path:
                raise PredecessorCycleError(path[path.index(cur) :] + [cur])
            path.append(cur)
            on_path.add(cur)
            cur = entry.prev_group
        for node in reversed(path):
            base += 1
            depth[node] = base
    return depth


def max_hops(groups: CompactionPlan | GroupsInput) -> int:
    """The longest predecessor chain, in hops, over ``groups`` (0 if empty).

    Accepts a :class:`CompactionPlan` (its entries are measured afresh, not
    read from ``plan.max_depth``) or any groups input.
    """
    if isinstance(groups, CompactionPlan):
        groups = groups.entries
    return max(chain_depths(groups).values(), default=0)


class _Replayer:
    """Computes full states along one forest with bounded memory.

    A state is kept only while something still needs it: each group starts
    with one use per child plus one for the caller's own read. The last user
    takes ownership of the dict and may mutate it, so a plain chain costs one
    delta application per group instead of one state copy.
    """

    def __init__(
        self,
        by_id: Mapping[int, StateGroupEntry],
        checked: Iterable[int],
        *,
        raise_on_cycle: bool,
    ) -> None:
        self._by_id = by_id
        self._raise_on_cycle = raise_on_cycle
        self._uses: Counter[int] = Counter(checked)
        for entry in by_id.values():
            if entry.prev_group is not None:
                self._uses[entry.prev_group] += 1
        self._memo: dict[int, State] = {}
        self._blocked: dict[int, int] = {}

    def _take(self, group_id: int) -> State:
        """Consume one use of a memoised state; returns a dict we may mutate."""
        self._uses[group_id] -= 1
        if self._uses[group_id] <= 0:
            return self._memo.pop(group_id)
        return dict(self._memo[group_id])

    def state(self, group_id: int) -> State | None:
        """The full state of ``group_id`` (read-only), or ``None`` if unresolvable."""
        path: list[int] = []
        on_path: set[int] = set()
        cur: int | None = group_id
        while cur is not None and cur not in self._memo:
            entry = self._by_id.get(cur)
            cyclic = cur in on_path
            if cyclic and self._raise_on_cycle:
                raise PredecessorCycleError(path[path.index(cur) :] + [cur])
            if cyclic or cur in self._blocked or entry is None:
                blocked_by = self._blocked.get(cur, cur)
                for node in path:
                    self._blocked[node] = blocked_by
                return None
            path.append(cur)
            on_path.add(cur)
            cur = entry.prev_group
        for node in reversed(path):
            prev = self._by_id[node].prev_group
            state = {} if prev is None else self._take(prev)
            self._memo[node] = apply_delta(state, self._by_id[node].delta)
        return self._memo[group_id]

    def done(self, group_id: int) -> None:
        """The caller has finished reading ``group_id``'s state."""
        if group_id in self._memo:
            self._uses[group_id] -= 1
            if self._uses[group_id] <= 0:
                del self._memo[group_id]


def verify(original_groups: GroupsInput, plan: CompactionPlan | GroupsInput) -> list[int]:
    """Check a plan against the original groups, exactly.

    Returns the sorted ids of every group whose full state under ``plan``
    differs from its original full state, or that is present on one side only,
    or whose plan chain is broken (dangling or cyclic). An original group that cannot be resolved
    (its chain reaches a purged group) passes only if the plan leaves it
    untouched (same predecessor and delta). An empty list means the plan is
    safe to apply.

    Memory is bounded by the states still needed by unprocessed groups (for
    id-ordered, persist-style chains: a handful), not by the room size.
    Raises :class:`PredecessorCycleError` if the *original* groups loop.
    """
    original = _index(original_groups)
    planned = _index(plan.entries if isinstance(plan, CompactionPlan) else plan)
    mismatched = set(original).symmetric_difference(planned)
    common = sorted(set(original) & set(planned))
    before = _Replayer(original, common, raise_on_cycle=True)
    after = _Replayer(planned, common, raise_on_cycle=False)
    for group_id in common:
        old_state = before.state(group_id)
        if old_state is None:
            old, new = original[group_id], planned[group_id]
            if (old.prev_group, dict(old.delta)) != (new.prev_group, dict(new.delta)):
                mismatched.add(group_id)
        elif after.state(group_id) != old_state:
            mismatched.add(group_id)
        before.done(group_id)
        after.done(group_id)
    return sorted(mismatched)
