"""Full state of a state group: roomstore's read against Synapse's own function.

usage: bench/with-postgres .venv/bin/python bench/state_vs_synapse.py \
    [--runs R] [--chain-runs C] [--groups N] [--profile]

For each engine (SQLite, PostgreSQL) one database holds roomstore's tables and,
beside them, Synapse-shaped ``state_group_edges(state_group, prev_state_group)``
and ``state_groups_state(state_group, room_id, type, state_key, event_id)``
with Synapse's indexes, holding the same groups (every delta row copied, with
the type, state key and event ID strings); on PostgreSQL then vacuumed and
analysed, as autovacuum would have done. Then, side by side in one run:

* theirs: ``StateGroupBackgroundUpdateStore._get_state_groups_from_groups_txn``
  from the installed matrix-synapse package (called, not copied: a recursive
  statement per group on PostgreSQL, a statement per hop on SQLite), through
  Synapse's ``LoggingTransaction`` on the same connection our store uses;
* ours: ``StateGroupStore.get_state`` (one recursive statement, state group
  cache cleared first), as interned ids, and with the names resolved by the
  store's interners (the same output as Synapse's: ``(type, state_key) ->
  event_id``), interner caches warm as in a running server.

Each call is timed inside its own transaction (ours as ids, ours named and
theirs take turns at going first for a group), and every result of ours is
checked equal to Synapse's. ``--profile`` also prints
cProfile's breakdown of our named call (the functions taking the most time). Two cases: a 10,000-entry
group at the end of a 100-hop delta chain, and N random groups (default
1,000) of the compaction benchmark's ``small`` dataset (403 rooms, 46,000
groups, snapshots every 100 hops, forks). The goal is ours <= 0.5x theirs.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twisted.internet import defer, task  # noqa: E402

from bench._common import bench_databases, print_table  # noqa: E402
from bench.dataset import load_dataset  # noqa: E402
from bench.event_store import build_long_chain  # noqa: E402

SYNAPSE_VERSION = "1.163.2"

#: Synapse's tables for state groups (synapse/storage/schema/state), with its indexes.
SYNAPSE_TABLES = (
    "CREATE TABLE state_group_edges (state_group BIGINT NOT NULL, prev_state_group BIGINT NOT NULL)",
    "CREATE UNIQUE INDEX state_group_edges_unique_idx ON state_group_edges (state_group, prev_state_group)",
    "CREATE INDEX state_group_edges_prev_idx ON state_group_edges (prev_state_group)",
    "CREATE TABLE state_groups_state (state_group BIGINT, room_id TEXT, type TEXT, state_key TEXT, event_id TEXT)",
    "CREATE INDEX state_groups_state_type_idx ON state_groups_state (state_group, type, state_key)",
)


def ensure_synapse():
    """matrix-synapse's state store module (installed into this virtualenv if
    missing: ``pip install --dry-run`` shows it changes none of roomstore's packages)."""
    from tests.synapse_oracle import prepare_synapse

    try:
        prepare_synapse()
        return importlib.import_module("synapse.storage.databases.state.bg_updates")
    except ImportError:
        print(f"installing matrix-synapse=={SYNAPSE_VERSION} into {sys.prefix} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", f"matrix-synapse=={SYNAPSE_VERSION}"], check=True
        )
        importlib.invalidate_caches()
        prepare_synapse()
        return importlib.import_module("synapse.storage.databases.state.bg_updates")


def copy_to_synapse_tables_txn(txn) -> None:
    """Synapse's tables from ours: the same groups, edges and delta rows."""
    for sql in SYNAPSE_TABLES:
        txn.execute(sql)
    txn.execute(
        "INSERT INTO state_group_edges (state_group, prev_state_group)"
        " SELECT state_group, prev_state_group FROM state_groups WHERE prev_state_group IS NOT NULL"
    )
    txn.execute(
        "INSERT INTO state_groups_state (state_group, room_id, type, state_key, event_id)"
        " SELECT d.state_group, r.room_id, k.type, k.state_key, i.event_id FROM state_group_deltas AS d"
        " JOIN state_groups AS g ON g.state_group = d.state_group JOIN rooms AS r ON r.room_nid = g.room_nid"
        " JOIN state_keys AS k ON k.type_key_nid = d.type_key_nid JOIN event_ids AS i ON i.event_nid = d.event_nid"
        " ORDER BY d.state_group"
    )
    txn.execute("ANALYZE")


def vacuum(store) -> None:
    """VACUUM ANALYZE, as autovacuum does on a running server: index-only
    scans (ours of state_groups' key, Synapse's of state_group_edges) read
    no table page once vacuum has marked the pages all-visible. CHECKPOINT
    first: the throwaway server commits asynchronously, and vacuum leaves a
    page unmarked until the WAL of its rows' commit is on disk."""
    conn = store.db.engine.session_connection("bench-vacuum")
    try:
        with conn.cursor() as cur:
            cur.execute("CHECKPOINT")
            cur.execute("VACUUM ANALYZE")
    finally:
        conn.close()


class SynapseCaller:
    """Calls Synapse's own function on our connection's cursor."""

    def __init__(self, engine_name: str, url: str) -> None:
        bg_updates = ensure_synapse()
        from synapse.storage.database import LoggingTransaction
        from synapse.storage.engines import create_engine

        config = {"name": "psycopg2" if engine_name == "postgres" else "sqlite3", "args": {}}
        self.engine = create_engine(config)
        self.LoggingTransaction = LoggingTransaction
        cls = bg_updates.StateGroupBackgroundUpdateStore
        # The function reads ``database_engine`` and, on SQLite, calls the
        # classmethod ``DatabasePool.simple_select_one_onecol_txn``: no HomeServer needed.
        from synapse.storage.database import DatabasePool

        self.store = cls.__new__(cls)
        self.store.database_engine = self.engine
        self.store.db_pool = DatabasePool
        self.function = cls._get_state_groups_from_groups_txn

    def txn(self, txn, group: int):
        # Synapse wraps the DB-API cursor itself (``txn._cursor``: the store's
        # cursor of this transaction); it converts ``?`` for psycopg2 itself.
        wrapped = self.LoggingTransaction(
            txn=txn._cursor, name="bench_state", server_name="bench", database_engine=self.engine
        )
        start = time.perf_counter()
        result = self.function(self.store, wrapped, [group])
        return time.perf_counter() - start, dict(result[group])


def ours_txn(txn, store, group: int, names: bool):
    store.state_groups._cache.clear()
    start = time.perf_counter()
    state = store.state_groups.get_state(txn, group)
    if names:
        state = store.reader._named_state(txn, state)
    return time.perf_counter() - start, state


async def measure(store, synapse: SynapseCaller, groups, runs: int):
    """(median ms ours ids, ours names, theirs) over ``groups`` x ``runs``, checked equal.

    The three calls take turns at going first for a group (the first warms
    the database's page cache for the next two)."""
    times: dict[str, list[float]] = {"ids": [], "named": [], "theirs": []}
    calls = {
        "ids": lambda group: store.db.run_interaction("bench_ours_ids", ours_txn, store, group, False),
        "named": lambda group: store.db.run_interaction("bench_ours", ours_txn, store, group, True),
        "theirs": lambda group: store.db.run_interaction("bench_synapse", synapse.txn, group),
    }
    names = list(calls)
    turn = 0
    for _ in range(runs):
        for group in groups:
            turn += 1
            results = {}
            for name in names[turn % 3 :] + names[: turn % 3]:
                elapsed, results[name] = await calls[name](group)
                times[name].append(elapsed * 1000)
            state, expected = results["named"], results["theirs"]
            if state != expected:
                raise SystemExit(
                    f"group {group}: our state differs from Synapse's ({len(state)} vs {len(expected)} entries)"
                )
    return (
        statistics.median(times["ids"]),
        statistics.median(times["named"]),
        statistics.median(times["theirs"]),
        len(expected),
    )


def profile_txn(txn, store, groups, repeat: int) -> str:
    """cProfile's top entries over ``repeat`` named reads of each of ``groups``."""
    profiler = cProfile.Profile()
    for _ in range(repeat):
        for group in groups:
            store.state_groups._cache.clear()
            profiler.enable()
            store.reader._named_state(txn, store.state_groups.get_state(txn, group))
            profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    return out.getvalue()


async def main(reactor, args) -> None:
    ensure_synapse()
    engines = bench_databases()
    rows = []
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(
        f"bench/state_vs_synapse.py: engines {', '.join(e for e, _ in engines)}; load average {load}"
        f" ({__import__('os').cpu_count()} cores)",
        flush=True,
    )
    for engine, new_url in engines:
        url = new_url()
        store, _big, last = await build_long_chain(url)
        try:
            long_group = (
                await store.db.run_interaction(
                    "group",
                    lambda t: t.execute(
                        "SELECT e.state_group FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
                        " WHERE i.event_id = ?",
                        (last,),
                    ).fetchone(),
                )
            )[0]
            info = load_dataset("small", roomstore_url=url, seed=1)
            await store.db.run_interaction("synapse_tables", copy_to_synapse_tables_txn)
            if engine == "postgres":
                vacuum(store)
            # Created only now: Synapse's PostgresEngine makes psycopg2 refuse
            # bytes parameters process-wide, which persisting events needs.
            synapse = SynapseCaller(engine, url)
            rng = random.Random(7)
            sample = sorted(rng.sample(range(info.first_group, info.last_group + 1), args.groups))
            for case, groups, runs in (
                ("10,000 entries, end of a 100-hop chain", [long_group], args.chain_runs),
                (f"{args.groups:,} random groups of 46,000 (per group)", sample, args.runs),
            ):
                # Warm the interners (as a running server's are) and the
                # database's caches for this case, then time it.
                await measure(store, synapse, groups, 1)
                ids, named, theirs, _ = await measure(store, synapse, groups, runs)
                if args.profile:
                    report = await store.db.run_interaction(
                        "profile", profile_txn, store, groups, max(1, 20 // len(groups))
                    )
                    print(f"  cProfile of our named read, {engine}, {case}:")
                    print(
                        "\n".join(
                            "    " + line
                            for line in report.splitlines()
                            if line.strip() and not line.lstrip().startswith(("Ordered", "List"))
                        ),
                        flush=True,
                    )
                rows.append([engine, case, ids, named, theirs, f"{named / theirs:.2f}", f"{ids / theirs:.2f}"])
                print(
                    f"  {engine}: {case}: ours {named:.3f} ms ({ids:.3f} ms as ids), Synapse {theirs:.3f} ms",
                    flush=True,
                )
        finally:
            await store.close()
    print()
    print(
        f"median ms per group; {args.chain_runs} run(s) of the chain case, {args.runs} of the random groups, after"
        " one warm-up run; every result checked equal"
    )
    print_table(["engine", "case", "ours (ids)", "ours (names)", "Synapse", "ours/Synapse", "ids/Synapse"], rows)
    print(f"load average at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each case (default 5)")
    parser.add_argument("--chain-runs", type=int, default=30, help="timed runs of the chain case (default 30)")
    parser.add_argument("--groups", type=int, default=1000, help="random groups (default 1000)")
    parser.add_argument("--profile", action="store_true", help="also print cProfile of our named read per case")
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
