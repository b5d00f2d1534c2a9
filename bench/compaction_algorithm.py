"""Benchmark the state-group compaction strategies on synthetic room histories.

Generates a few large rooms the way a homeserver persists them (each new state
group a delta against its parent, a full snapshot once a chain reaches 100
hops), with heavy membership churn (thousands of users joining and leaving,
some of them over and over), occasional non-member state changes, rare state
removals, and forks: concurrent branches whose groups interleave in id order
until a state-resolution group merges them.

Then runs ``levels`` and ``smart`` on the same data (median wall time of 3 runs
each), verifies every plan exactly, and prints a table.

    PYTHONPATH=. .venv/bin/python bench/compaction_algorithm.py --size small
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import attrs

from roomstore.compaction import (
    DEFAULT_LEVELS,
    CompactionPlan,
    StateGroupEntry,
    compress_levels,
    compress_smart,
    count_rows,
    levels_hop_bound,
    max_hops,
    verify,
)

#: Synapse's persist-time limit: a snapshot once a chain would exceed it.
PERSIST_MAX_HOPS = 100
#: Keys below this id are non-member state (create, power levels, topic...).
MEMBER_KEY_BASE = 1000


@attrs.define
class RoomSpec:
    """Shape of one synthetic room."""

    name: str
    groups: int
    users: int
    hot_users: int  # users who flap (join/leave) over and over, e.g. bridges
    hot_share: float  # share of membership events by hot users
    other_share: float  # share of non-member state events
    fork_rate: float  # chance a new group opens a fork
    removal_rate: float  # chance a group also removes a non-member key


SIZES: dict[str, list[RoomSpec]] = {
    "small": [
        RoomSpec("bridged", 12_000, 5_000, 60, 0.35, 0.02, 0.01, 0.001),
        RoomSpec("federated", 10_000, 4_000, 40, 0.20, 0.05, 0.05, 0.002),
        RoomSpec("community", 8_000, 3_000, 20, 0.10, 0.10, 0.02, 0.002),
    ],
    "large": [
        RoomSpec("bridged", 60_000, 20_000, 300, 0.35, 0.02, 0.01, 0.001),
        RoomSpec("federated", 40_000, 12_000, 150, 0.20, 0.05, 0.05, 0.002),
        RoomSpec("community", 30_000, 8_000, 80, 0.10, 0.10, 0.02, 0.002),
    ],
}


class _Room:
    """Simulates one room's state and persists state groups like a homeserver."""

    def __init__(self, spec: RoomSpec, rng: random.Random, first_group: int) -> None:
        self.spec = spec
        self.rng = rng
        self.next_group = first_group
        self.next_event = first_group * 10
        self.groups: list[StateGroupEntry] = []
        self.states: dict[int, dict[int, int]] = {}  # live branch tips only
        self.depth: dict[int, int] = {}

    def _event(self) -> int:
        self.next_event += 1
        return self.next_event

    def _change(self, state: dict[int, int]) -> dict[int, int | None]:
        """One state event (plus, rarely, a removal) against ``state``."""
        spec, rng = self.spec, self.rng
        change: dict[int, int | None] = {}
        if rng.random() < spec.other_share:
            change[rng.randrange(1, 40)] = self._event()  # topic, power levels...
        else:
            if rng.random() < spec.hot_share:
                user = rng.randrange(spec.hot_users)
            else:
                user = rng.randrange(spec.users)
            change[MEMBER_KEY_BASE + user] = self._event()  # join/leave/invite/ban
        if rng.random() < spec.removal_rate:
            removable = [k for k in range(1, 40) if k in state]
            if removable:
                change[rng.choice(removable)] = None
        return change

    def persist(self, parent: int | None, change: dict[int, int | None], *, last_use: bool) -> int:
        """Store a new group for ``parent``'s state plus ``change``.

        ``last_use`` says nothing else will extend ``parent``, so its state
        dict can be taken over instead of copied.
        """
        group = self.next_group
        self.next_group += 1
        if parent is None:
            state: dict[int, int] = {}
        elif last_use:
            state = self.states.pop(parent)
        else:
            state = dict(self.states[parent])
        for key, value in change.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        if parent is None or self.depth[parent] + 1 >= PERSIST_MAX_HOPS:
            self.groups.append(StateGroupEntry(group, None, dict(state)))
            self.depth[group] = 0
        else:
            self.groups.append(StateGroupEntry(group, parent, change))
            self.depth[group] = self.depth[parent] + 1
        self.states[group] = state
        return group

    def generate(self) -> list[StateGroupEntry]:
        spec, rng = self.spec, self.rng
        create = {0: self._event()}
        for key in range(1, 8):  # power levels, join rules, name, topic...
            create[key] = self._event()
        head = self.persist(None, create, last_use=True)
        while len(self.groups) < spec.groups:
            if rng.random() < spec.fork_rate:
                head = self._fork(head)
            else:
                head = self.persist(head, self._change(self.states[head]), last_use=True)
        return self.groups

    def _fork(self, base: int) -> int:
        """Two concurrent branches off ``base``, interleaved, then merged."""
        rng = self.rng
        tips = [base, base]
        for _ in range(rng.randint(2, 12)):
            side = rng.randrange(2)
            tip = tips[side]
            # The fork point is shared by both branches until both moved on.
            shared = tip == base and tips[1 - side] == base
            tips[side] = self.persist(tip, self._change(self.states[tip]), last_use=not shared)
        # State resolution: the merged state is stored as a delta against one tip.
        ours, theirs = self.states[tips[0]], self.states[tips[1]]
        merged = {k: v for k, v in theirs.items() if ours.get(k) != v}
        merge = self.persist(tips[0], merged, last_use=tips[0] != tips[1])
        self.states.pop(tips[1], None)
        return merge


def generate_rooms(size: str, seed: int = 42) -> list[tuple[str, list[StateGroupEntry]]]:
    """The rooms for ``size``; deterministic for a given seed."""
    rng = random.Random(seed)
    rooms = []
    first = 1
    for spec in SIZES[size]:
        groups = _Room(spec, rng, first).generate()
        first = groups[-1].group_id + 1
        rooms.append((spec.name, groups))
    return rooms


@attrs.define
class Result:
    """One strategy's totals over all rooms (or one room's, in ``rooms``)."""

    strategy: str
    rows_before: int = 0
    rows_after: int = 0
    max_hops: int = 0
    seconds: float = 0.0
    mismatches: int = 0
    rooms: dict[str, Result] = attrs.Factory(dict)

    def add(self, other: Result) -> None:
        self.rows_before += other.rows_before
        self.rows_after += other.rows_after
        self.max_hops = max(self.max_hops, other.max_hops)
        self.seconds += other.seconds
        self.mismatches += other.mismatches


def run(size: str, repeats: int, window: int, levels: Sequence[int]) -> list[Result]:
    t0 = time.perf_counter()
    rooms = generate_rooms(size)
    print(
        f"generated {len(rooms)} rooms, "
        f"{sum(len(g) for _, g in rooms):,} state groups, "
        f"{sum(count_rows(g) for _, g in rooms):,} rows "
        f"in {time.perf_counter() - t0:.1f}s\n"
    )
    strategies = {
        "levels": lambda g: compress_levels(g, levels, window=window),
        "smart": lambda g: compress_smart(g, None, window, levels=levels),
    }
    results = []
    for name, compress in strategies.items():
        result = Result(name)
        for room, groups in rooms:
            timings = []
            plan: CompactionPlan | None = None
            for _ in range(repeats):
                start = time.perf_counter()
                plan = compress(groups)
                timings.append(time.perf_counter() - start)
            assert plan is not None
            room_result = Result(
                name,
                rows_before=plan.rows_before,
                rows_after=plan.rows_after,
                max_hops=max_hops(plan),  # measured afresh, not read from the plan
                seconds=statistics.median(timings),
                mismatches=len(verify(groups, plan)),
            )
            result.rooms[room] = room_result
            result.add(room_result)
        results.append(result)
    return results


def print_table(results: list[Result], per_room: bool = True) -> None:
    header = (
        f"{'strategy':<18}{'rows before':>13}{'rows after':>12}"
        f"{'ratio':>8}{'max hops':>10}{'wall time':>11}{'verify':>8}"
    )

    def line(label: str, r: Result) -> None:
        print(
            f"{label:<18}{r.rows_before:>13,}{r.rows_after:>12,}"
            f"{r.rows_after / r.rows_before:>8.4f}{r.max_hops:>10}"
            f"{r.seconds:>10.2f}s{'ok' if not r.mismatches else r.mismatches:>8}"
        )

    print(header)
    print("-" * len(header))
    for r in results:
        line(r.strategy, r)
    base = results[0]
    for r in results[1:]:
        change = (r.rows_after - base.rows_after) / base.rows_after
        print(f"{r.strategy} vs {base.strategy}: {change:+.1%} rows after")
    if per_room:
        print("\nper room:")
        for r in results:
            for room, rr in r.rooms.items():
                line(f"{r.strategy} {room}", rr)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=None)
    args = parser.parse_args(argv)
    from roomstore.compaction import DEFAULT_WINDOW

    window = args.window or DEFAULT_WINDOW
    levels = DEFAULT_LEVELS
    print(
        f"size={args.size} levels={levels} (hop bound {levels_hop_bound(levels)}) "
        f"window={window} repeats={args.repeats} (median wall time per room, summed)"
    )
    print_table(run(args.size, args.repeats, window, levels))


if __name__ == "__main__":
    main()
