"""Helpers that build state-group forests for the compaction tests."""

from __future__ import annotations

import random
from collections.abc import Sequence

from roomstore.compaction.model import PlanEntry, StateGroupEntry


def chain(*deltas: dict[int, int | None], start: int = 1) -> list[StateGroupEntry]:
    """A linear chain: the first delta is a snapshot, each next one a delta."""
    groups = []
    for offset, delta in enumerate(deltas):
        group_id = start + offset
        prev = None if offset == 0 else group_id - 1
        groups.append(StateGroupEntry(group_id, prev, dict(delta)))
    return groups


def persisted_room(
    n: int,
    *,
    seed: int,
    keys: int = 200,
    snapshot_every: int = 100,
    fork_rate: float = 0.05,
    removal_rate: float = 0.05,
    start: int = 1,
) -> list[StateGroupEntry]:
    """Groups as a homeserver persists them: a delta against the parent, a
    snapshot once the chain reaches ``snapshot_every`` hops, forks from recent
    groups, occasional key removals (tombstones)."""
    rng = random.Random(seed)
    groups: list[StateGroupEntry] = []
    states: dict[int, dict[int, int]] = {}
    depth: dict[int, int] = {}
    parent: int | None = None
    event = 10_000
    for group_id in range(start, start + n):
        state = dict(states[parent]) if parent is not None else {}
        delta: dict[int, int | None] = {}
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            event += 1
            delta[rng.randrange(keys)] = event
        if state and rng.random() < removal_rate:
            delta[rng.choice(sorted(state))] = None
        for key, value in delta.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        if parent is None or depth[parent] + 1 >= snapshot_every:
            groups.append(StateGroupEntry(group_id, None, dict(state)))
            depth[group_id] = 0
        else:
            groups.append(StateGroupEntry(group_id, parent, delta))
            depth[group_id] = depth[parent] + 1
        states[group_id] = state
        if rng.random() < fork_rate:
            parent = rng.choice(list(states)[-15:])
        else:
            parent = group_id
    return groups


def apply_plan(groups: Sequence[StateGroupEntry], writes: Sequence[PlanEntry]) -> list[StateGroupEntry]:
    """``groups`` as stored after writing ``writes``."""
    by_id = {g.group_id: g for g in groups}
    for entry in writes:
        by_id[entry.group_id] = entry.as_input()
    return [by_id[k] for k in sorted(by_id)]


def chunked(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]
