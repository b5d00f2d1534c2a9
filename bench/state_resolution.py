"""State resolution of a large fork: roomstore's against Synapse's, same events, same run.

usage: bench/with-postgres .venv/bin/python bench/state_resolution.py [--members N] [--conflicted C] [--runs R]
       [--version V] [--engines sqlite,postgres]

A public room of room version V (default 10) with N members (default 10,000), every event with its real auth
events (``tests/pdu/rooms.py``'s builder, the auth rules' selection); then two branches from its last event: on
one, C members (default 1,000) change their display names; on the other, the same C members change theirs to
something else and the power levels change. Resolving the two branches' states: C + 1 conflicted keys, and
the auth difference of both branches' chains.

Timed, taking turns, ``--runs`` times (median printed):

* Synapse: ``synapse.state.v2.resolve_events_with_store`` from the installed matrix-synapse 1.163.2 (called, not
  copied), over its ``StateResolutionStore`` protocol answered from the events in memory (the auth chains walked
  in memory: Synapse's fastest case, no database);
* ours, pure: ``roomstore.resolution.resolve_state`` over ``MemoryEventSource`` (the same in memory);
* ours, in the store (per engine): the events persisted, then the two states resolved in one transaction over
  ``TransactionEventSource`` (the auth chain difference from ``event_auth_edges`` in one recursive query per set)
  — what a write that meets the fork runs: the first run parses every event from its stored bytes, the later ones
  find them in the store's cache of parsed events (``ParsedEventCache``, as Synapse's event cache), both printed.

Every result is checked equal to Synapse's. The goal (issue 39): ours at most 1.0x Synapse's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twisted.internet import defer, task  # noqa: E402

from bench._common import bench_databases, print_table  # noqa: E402


def build_fork(version: str, members: int, conflicted: int):
    """(room, state set A, state set B) as (type, state key) -> event ID."""
    from tests.pdu.rooms import Room

    room = Room(version)
    users = [f"@user{i}:example.org" for i in range(members)]
    room.standard(join_rule="public", members=users)
    base = dict(room.state)
    head = list(room.leaves)
    changed = users[:conflicted]

    def branch(tag: str, levels: bool):
        room.state, room.leaves = dict(base), list(head)
        for user in changed:
            room.member(user, "join", content={"displayname": f"{user} {tag}"})
        if levels:
            room.power_levels(
                {room.creator: 100} if not room.room_version.creators_have_infinite_power else {},
                users_default=0,
                state_default=50,
            )
        return {key: pdu.event_id for key, pdu in room.state.items()}

    return room, branch("a", False), branch("b", True)


def synapse_resolver(room, state_sets):
    from tests.pdu.rooms import Oracle

    oracle = Oracle()
    for event in room.events.values():
        oracle.event(event)  # converted once, outside the timing (Synapse holds its events parsed)
    return lambda: oracle.resolve(room.version, state_sets, room.events)


def ours_pure(room, state_sets):
    from roomstore.resolution import MemoryEventSource, resolve_state

    source = MemoryEventSource(room.events)
    return lambda: resolve_state(room.room_version, state_sets, source)


async def open_in_store(reactor, url: str, room):
    """A store holding the room's events, and a resolver of a state list in
    one transaction of it: (store, resolve(state_sets) -> Deferred of
    (seconds, result))."""
    from roomstore.events.resolution_source import TransactionEventSource
    from roomstore.events.write.batch import EventToPersist
    from roomstore.resolution import resolve_state
    from roomstore.store import RoomStore

    store = await RoomStore.open(url, reactor=reactor)
    events = list(room.events.values())
    for start in range(0, len(events), 500):
        await store.persist_events([EventToPersist(e.raw, room.version) for e in events[start : start + 500]])
    # The persists parsed the events: start cold, as a store that never read them.
    store.persister.parsed_events.clear()

    def resolve_txn(txn, state_sets):
        # With the store's cache of parsed events, as a write's resolution has it.
        source = TransactionEventSource(txn, store.interners, {}, store.persister.parsed_events)
        started = time.perf_counter()
        resolved = resolve_state(room.room_version, state_sets, source)
        return time.perf_counter() - started, resolved

    return store, lambda state_sets: store.db.run_interaction("bench_resolution", resolve_txn, state_sets)


def timed(fn, runs: int) -> tuple[list[float], dict]:
    times, result = [], {}
    for _ in range(runs):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return times, result


async def main(reactor, args) -> None:
    started = time.perf_counter()
    room, a, b = build_fork(args.version, args.members, args.conflicted)
    state_sets = [a, b]
    print(
        f"room version {args.version}: {len(room.events):,} events, "
        f"{sum(1 for k in set(a) | set(b) if a.get(k) != b.get(k)):,} conflicted keys "
        f"(built in {time.perf_counter() - started:.1f} s)",
        flush=True,
    )
    theirs_fn, pure_fn = synapse_resolver(room, state_sets), ours_pure(room, state_sets)
    wanted = args.engines.split(",")
    stores = [
        (engine, *await open_in_store(reactor, new_url(), room))
        for engine, new_url in bench_databases()
        if engine in wanted
    ]
    times: dict[str, list[float]] = {"theirs": [], "pure": [], **{e: [] for e, _, _ in stores}}
    cold: dict[str, float] = {}
    try:
        for _ in range(args.runs + 1):  # turns, so load on the machine falls on all alike
            t, theirs = timed(theirs_fn, 1)
            times["theirs"] += t
            t, pure = timed(pure_fn, 1)
            times["pure"] += t
            assert pure == theirs, "ours (pure) differs from Synapse's"
            for engine, _, resolve in stores:
                seconds, result = await resolve(state_sets)
                assert result == theirs, f"ours ({engine}) differs from Synapse's"
                if engine in cold:
                    times[engine].append(seconds)
                else:
                    cold[engine] = seconds  # the first: no event parsed yet
    finally:
        for _, store, _ in stores:
            await store.close()
    base = statistics.median(times["theirs"][1:])
    rows = [
        ("Synapse resolve_events_with_store (memory)", base, 1.0),
        ("ours, pure (memory)", statistics.median(times["pure"][1:]), statistics.median(times["pure"][1:]) / base),
    ]
    for engine, _, _ in stores:
        rows.append(
            (
                f"ours, in the store ({engine}), first run: events parsed from the database",
                cold[engine],
                cold[engine] / base,
            )
        )
        rows.append(
            (
                f"ours, in the store ({engine}), later runs: parsed events cached",
                statistics.median(times[engine]),
                statistics.median(times[engine]) / base,
            )
        )
    print(f"medians of {args.runs} rounds after a first (Synapse and pure: its first round left out too)")
    print_table(["resolver", "median s", "x Synapse"], [(n, f"{s:.3f}", f"{r:.2f}x") for n, s, r in rows])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--conflicted", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--version", default="10")
    parser.add_argument("--engines", default="sqlite,postgres")
    arguments = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, arguments)))
