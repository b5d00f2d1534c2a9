"""Benchmark: ``roomstore-compact --synapse`` against synapse_auto_compressor on a real Synapse's database.

The database is made by a real Synapse (matrix-synapse 1.163.2 from ``.venv-synapse``, started once on a fresh
PostgreSQL database and stopped: its full schema, indexes and sequences), then filled with generated state groups
in Synapse's layout (``state_groups``, ``state_group_edges``, ``state_groups_state``; the generator of
``bench/compaction.py``: membership churn, hot users, forks, a snapshot every 100 hops). Two workloads:

* ``room``: ONE room, by default of about 1M, 2.5M and 5.2M state rows (``--groups``), so the memory columns
  show how each tool grows with the room;
* ``rooms``: a database of 1,000 rooms of mixed sizes (960 small chats, 30 bridged rooms, 10 large federated ones).

For each, the filled database is copied twice (``CREATE DATABASE ... TEMPLATE``), and on one copy each:

* ours: ``bin/roomstore-compact --synapse URL`` on a Spark standalone cluster started here on loopback (one
  worker, 2 cores) with 1 GiB driver and executor memory; peak RSS (``VmHWM``) of every process of the job and
  the cluster sampled from ``/proc``, the largest reported;
* theirs: synapse_auto_compressor 0.1.2 (PyPI; 0.1.4 is an empty wheel) in a child process until it has no work
  left, with the same chunk size and levels; its peak RSS from ``wait4``.

Reported side by side: state rows (``state_groups_state``) and edges after, bytes of the three tables with their
indexes after ``VACUUM FULL``, wall time, peak RSS, the ratios ours/theirs, and mismatches: every group's full
state in both databases after the run checked against the generator's groups.

    bench/with-postgres .venv/bin/python bench/compaction_synapse.py \
        [--workloads room,rooms] [--groups 26000,50500,95000]

Each comparison also prints the job's phase timings (its summary's ``timings_s``). Exploring: ``--ours-only N``
fills each workload once and runs only ours N times on fresh copies (no auto-compressor); ``--explain-ms MS`` with
it has PostgreSQL log the plans of statements slower than MS (auto_explain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import print_table  # noqa: E402
from bench.compaction import (  # noqa: E402
    COMPRESSOR_VERSION,
    LEVELS,
    check_all,
    create_database,
    ensure_compressor,
    table_figures,
)
from bench.compaction_memory import drop, huge_room, load_average, run_ours, run_theirs  # noqa: E402
from bench.dataset import RoomShape, load_dataset, read_synapse_room  # noqa: E402
from bench.import_synapse import synapse_schema_database  # noqa: E402
from tests.compaction.spark_cluster import SparkCluster  # noqa: E402

MIB = 1024 * 1024
SYNAPSE_TABLES = ["state_groups_state", "state_group_edges", "state_groups"]
#: 1,000 rooms of mixed sizes: many small chats, some bridged rooms with heavy churn, a few large federated ones.
MIXED_ROOMS = (
    RoomShape("chat", 960, 80, 30, 4, 0.3, 0.10, 0.03),
    RoomShape("bridged", 30, 3_000, 1_500, 40, 0.35, 0.02, 0.01),
    RoomShape("federated", 10, 8_000, 3_000, 60, 0.20, 0.05, 0.05),
)


class KeyIds(dict):
    """(type, state_key) -> an id, given on first use: the generator's groups and the tables read back share it."""

    def __missing__(self, key):
        value = self[key] = len(self) + 1
        return value


def edge_count(url: str) -> int:
    import psycopg2

    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM state_group_edges")
        return cur.fetchone()[0]


def compare(admin: str, label: str, shapes, seed: int, cluster: SparkCluster, memory: str, chunk_groups: int) -> list:
    """Fill a Synapse-made database with ``shapes``, run both tools on copies; one table row of figures."""
    tag = f"{os.getpid()}_{label.replace(' ', '_').replace(',', '')}"
    work = tempfile.mkdtemp(prefix="roomstore-bench-synapse-")
    template = synapse_schema_database(admin)
    started = time.perf_counter()
    info = load_dataset(synapse_url=template, seed=seed, shapes=shapes)
    info.key_ids = KeyIds()  # only Synapse's tables were written: no interned ids to reuse
    print(
        f"{label}: {len(info.rooms):,} room(s), {info.state_groups:,} groups, {info.rows:,} state rows, loaded into a"
        f" Synapse-made database in {time.perf_counter() - started:.0f}s",
        flush=True,
    )
    template_name = urllib.parse.urlsplit(template).path.lstrip("/")
    ours = create_database(admin, f"rs_bench_syn_ours_{tag}", template_name)
    theirs = create_database(admin, f"rs_bench_syn_theirs_{tag}", template_name)
    try:
        rows_before = table_figures(template, "state_groups_state", SYNAPSE_TABLES, full=True)
        edges_before = edge_count(template)
        load_ours = load_average()
        summary = os.path.join(work, "summary.json")
        ours_s, roles = run_ours(
            ours, cluster, memory, chunk_groups, work, target="--synapse", extra=("--summary-json", summary)
        )
        ours_peak = max(peak for _, peak in roles.values())
        print(
            f"  roomstore-compact --synapse: {ours_s:.0f}s, largest process {ours_peak / MIB:.0f} MiB"
            f" (load before {load_ours})",
            flush=True,
        )
        timings = json.loads(Path(summary).read_text())["timings_s"]
        print("  the job's phases (timings_s): " + ", ".join(f"{k} {v}" for k, v in timings.items()), flush=True)
        print(
            "  peak RSS MiB by role: "
            + ", ".join(f"{role} {peak / MIB:.0f} ({count})" for role, (count, peak) in sorted(roles.items())),
            flush=True,
        )
        load_theirs = load_average()
        theirs_s, theirs_peak = run_theirs(theirs, chunk_groups, work)
        print(
            f"  synapse_auto_compressor: {theirs_s:.0f}s, peak RSS {theirs_peak / MIB:.0f} MiB"
            f" (load before {load_theirs})",
            flush=True,
        )
        ours_after = table_figures(ours, "state_groups_state", SYNAPSE_TABLES, full=True)
        theirs_after = table_figures(theirs, "state_groups_state", SYNAPSE_TABLES, full=True)
        ours_bad = check_all(info, lambda i: read_synapse_room(ours, info.rooms[i][0], info.key_ids))
        theirs_bad = check_all(info, lambda i: read_synapse_room(theirs, info.rooms[i][0], info.key_ids))
        print(
            f"  verified all {info.state_groups:,} groups against the generator: mismatched ours {ours_bad[0]},"
            f" theirs {theirs_bad[0]}",
            flush=True,
        )
        return [
            label,
            f"{info.rows:,}",
            rows_before[0],
            ours_after[0],
            theirs_after[0],
            f"{ours_after[0] / theirs_after[0]:.2f}x",
            f"{edges_before:,} / {edge_count(ours):,} / {edge_count(theirs):,}",
            f"{rows_before[1] / MIB:.0f} / {ours_after[1] / MIB:.0f} / {theirs_after[1] / MIB:.0f}",
            f"{ours_s:.0f}",
            f"{theirs_s:.0f}",
            f"{ours_s / theirs_s:.2f}x",
            f"{ours_peak / MIB:.0f}",
            f"{theirs_peak / MIB:.0f}",
            f"{ours_bad[0]} / {theirs_bad[0]}",
        ]
    finally:
        for url in (ours, theirs, template):
            drop(admin, url)


def explain_slow(admin: str, ms: int) -> str:
    """Exploring: PostgreSQL logs the plan (EXPLAIN ANALYZE) of every statement slower than ``ms`` to its server
    log (auto_explain in new sessions); the log's path."""
    import psycopg2

    conn = psycopg2.connect(admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("LOAD 'auto_explain'")  # its settings are known to ALTER SYSTEM once loaded
        for setting, value in (
            ("session_preload_libraries", "auto_explain"),
            ("auto_explain.log_min_duration", ms),
            ("auto_explain.log_analyze", "on"),
            ("auto_explain.log_nested_statements", "on"),
        ):
            cur.execute(f"ALTER SYSTEM SET {setting} = %s", (str(value),))
        cur.execute("SELECT pg_reload_conf()")
        cur.execute("SHOW data_directory")
        data = cur.fetchone()[0]
    conn.close()
    return str(Path(data).parent / "server.log")


def profile_ours(
    admin: str,
    label: str,
    shapes,
    seed: int,
    cluster: SparkCluster,
    memory: str,
    chunk_groups: int,
    runs: int,
    explain_ms: int = 0,
) -> None:
    """Exploring: fill once, then ours alone ``runs`` times, each on a fresh copy; each run's wall time, the job's
    phase timings (its summary's ``timings_s``), rows after and mismatches. No auto-compressor, no table."""
    tag = f"{os.getpid()}_profile"
    work = tempfile.mkdtemp(prefix="roomstore-bench-synapse-")
    template = synapse_schema_database(admin)
    started = time.perf_counter()
    info = load_dataset(synapse_url=template, seed=seed, shapes=shapes)
    info.key_ids = KeyIds()
    print(
        f"{label}: {len(info.rooms):,} room(s), {info.state_groups:,} groups, {info.rows:,} state rows, loaded in"
        f" {time.perf_counter() - started:.0f}s",
        flush=True,
    )
    template_name = urllib.parse.urlsplit(template).path.lstrip("/")
    server_log = explain_slow(admin, explain_ms) if explain_ms else None
    try:
        for run in range(runs):
            ours = create_database(admin, f"rs_bench_syn_ours_{tag}", template_name)
            summary = os.path.join(work, f"summary{run}.json")
            load = load_average()
            seconds, roles = run_ours(
                ours, cluster, memory, chunk_groups, work, target="--synapse", extra=("--summary-json", summary)
            )
            timings = json.loads(Path(summary).read_text())["timings_s"]
            rows = table_figures(ours, "state_groups_state", SYNAPSE_TABLES, full=False)[0]
            bad = check_all(info, lambda i: read_synapse_room(ours, info.rooms[i][0], info.key_ids))
            print(
                f"  run {run + 1}: {seconds:.1f}s (load before {load}), rows after {rows:,}, mismatched {bad[0]},"
                f" largest process {max(p for _, p in roles.values()) / MIB:.0f} MiB",
                flush=True,
            )
            print("    timings_s: " + ", ".join(f"{k} {v}" for k, v in timings.items()), flush=True)
            drop(admin, ours)
            if server_log:
                import shutil

                shutil.copy(server_log, os.path.join(work, "server.log"))
                print(f"    slow statements' plans: {work}/server.log", flush=True)
    finally:
        drop(admin, template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="room,rooms", help="room (one large room per --groups), rooms (1,000)")
    parser.add_argument(
        "--groups",
        default="26000,50500,95000",
        help="state groups of the one room, a size per comma (default: ~1M, 2.5M, 5.2M rows)",
    )
    parser.add_argument("--memory", default="1g", help="driver and executor memory (default 1g)")
    parser.add_argument("--chunk-groups", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--ours-only",
        type=int,
        default=0,
        metavar="N",
        help="exploring: fill each workload once and run only ours N times on fresh copies,"
        " printing the job's phase timings (no auto-compressor, no table)",
    )
    parser.add_argument(
        "--explain-ms",
        type=int,
        default=0,
        metavar="MS",
        help="with --ours-only: log the plans of statements slower than MS (auto_explain)",
    )
    args = parser.parse_args(argv)
    admin = os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    if not admin:
        raise SystemExit("needs PostgreSQL: run through bench/with-postgres (sets ROOMSTORE_BENCH_POSTGRES)")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - {"room", "rooms"}:
        raise SystemExit("--workloads takes room, rooms or both")
    ensure_compressor()
    print(f"load average at start: {load_average()} ({os.cpu_count()} cores)", flush=True)
    rows = []
    with SparkCluster(workers=1, cores=2, memory=args.memory) as cluster:
        print(f"Spark standalone cluster at {cluster.url} (1 worker, 2 cores, {args.memory})", flush=True)
        if args.ours_only:
            for workload in workloads:
                shapes = list(MIXED_ROOMS) if workload == "rooms" else [huge_room(int(args.groups.split(",")[0]))]
                profile_ours(
                    admin,
                    workload,
                    shapes,
                    args.seed,
                    cluster,
                    args.memory,
                    args.chunk_groups,
                    args.ours_only,
                    args.explain_ms,
                )
            return
        if "room" in workloads:
            for groups in (int(g) for g in args.groups.split(",")):
                rows.append(
                    compare(
                        admin,
                        f"one room, {groups:,} groups",
                        [huge_room(groups)],
                        args.seed,
                        cluster,
                        args.memory,
                        args.chunk_groups,
                    )
                )
        if "rooms" in workloads:
            rows.append(
                compare(admin, "1,000 rooms", list(MIXED_ROOMS), args.seed, cluster, args.memory, args.chunk_groups)
            )
    print()
    print(
        f"driver and executor memory {args.memory}, --chunk-groups {args.chunk_groups}, levels {LEVELS};"
        f" synapse_auto_compressor {COMPRESSOR_VERSION} with chunk_size {args.chunk_groups}"
    )
    print_table(
        [
            "workload",
            "state rows",
            "rows before",
            "rows after: ours",
            "theirs",
            "rows ours/theirs (goal <= 1.0x)",
            "edges before / ours / theirs",
            "MiB before / ours / theirs",
            "ours s",
            "theirs s",
            "time ours/theirs (goal <= 0.5x)",
            "ours peak MiB (largest process)",
            "theirs peak MiB",
            "mismatched ours / theirs",
        ],
        rows,
    )
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
