"""Benchmark: the state compaction Spark job against synapse_auto_compressor.

Generates a realistic dataset (bench/dataset.py: many small rooms,
a few large ones with heavy membership churn and forks; ``--size small`` by
default, ``--size large`` has over five million state rows), loads the same
logical data into roomstore's tables and into Synapse-shaped tables in a
separate PostgreSQL database, then runs

* our job: ``bin/roomstore-compact --master local[*]`` (spark-submit, wall
  time includes Spark's start-up), and
* matrix-org's ``synapse_auto_compressor`` (0.1.2 from PyPI, installed into
  this virtualenv if missing) until it has no work left,

and prints, for both: rows and bytes before/after (bytes of all state tables
with their indexes, measured after ``VACUUM FULL``, which is what reclaiming
the space costs an operator), wall time, the longest chain, and mismatches:
every group's full state after compaction is checked against the generator's
original groups (``roomstore.compaction.verify``, room by room).

    bench/with-postgres .venv/bin/python bench/compaction.py --size small
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import print_table  # noqa: E402
from bench.dataset import (  # noqa: E402
    load_dataset,
    prepare_roomstore_schema,
    prepare_synapse_schema,
    read_roomstore_room,
    read_synapse_room,
    room_entries,
    room_positions,
)
from roomstore.compaction import chain_depths, levels_hop_bound, verify  # noqa: E402

COMPRESSOR_VERSION = "0.1.2"  # 0.1.4 on PyPI is an empty wheel
LEVELS = "100,50,25"


def ensure_compressor():
    try:
        return importlib.import_module("synapse_auto_compressor")
    except ImportError:
        print(f"installing synapse-auto-compressor=={COMPRESSOR_VERSION} into {sys.prefix} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", f"synapse-auto-compressor=={COMPRESSOR_VERSION}"],
            check=True,
        )
        importlib.invalidate_caches()
        return importlib.import_module("synapse_auto_compressor")


def create_database(admin: str, name: str, template: str = "template0") -> str:
    """A new database ``name`` (dropped first if there), a copy of ``template``; its URL."""
    import psycopg2

    conn = psycopg2.connect(admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cur.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    conn.close()
    parsed = urllib.parse.urlsplit(admin)
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, "/" + name, "", ""))


def table_figures(url: str, rows_table: str, tables: list[str], full: bool) -> tuple[int, int]:
    """(rows of ``rows_table``, bytes of ``tables`` with indexes) after VACUUM (FULL)."""
    import psycopg2

    conn = psycopg2.connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        for table in tables:
            cur.execute(f"VACUUM {'FULL ' if full else ''}ANALYZE {table}")
        cur.execute(f"SELECT COUNT(*) FROM {rows_table}")
        rows = cur.fetchone()[0]
        size = 0
        for table in tables:
            cur.execute("SELECT pg_total_relation_size(%s)", (table,))
            size += cur.fetchone()[0]
    conn.close()
    return rows, size


OURS_TABLES = ["state_group_deltas", "state_groups"]
THEIR_TABLES = ["state_groups_state", "state_group_edges", "state_groups"]


def check_all(info, read_room: Callable[[int], list]) -> tuple[int, int, int]:
    """(mismatched groups, rooms with mismatches, longest chain) over every room."""
    mismatched = rooms_bad = longest = 0
    positions = room_positions(info.spec)
    for index in range(len(info.rooms)):
        original = room_entries(info.spec, index, info.key_ids, positions[index])
        stored = read_room(index)
        bad = verify(original, stored)
        mismatched += len(bad)
        rooms_bad += bool(bad)
        longest = max(longest, max(chain_depths(stored).values(), default=0))
    return mismatched, rooms_bad, longest


def run_ours(url: str, work: str, extra: list[str]) -> tuple[float, dict]:
    summary = os.path.join(work, "summary.json")
    cmd = [
        str(ROOT / "bin" / "roomstore-compact"),
        "--master",
        "local[*]",
        "--db",
        url,
        "--levels",
        LEVELS,
        "--summary-json",
        summary,
        *extra,
    ]
    log_path = os.path.join(work, "job.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if status != 0:
        print(Path(log_path).read_text()[-4000:])
        raise SystemExit(f"the compaction job failed (exit {status}); log above")
    return seconds, json.loads(Path(summary).read_text())


def run_theirs(compressor, url: str, chunk_size: int, work: str) -> tuple[float, int]:
    """Wall time, and how many chunks it skipped ("tried to increase the
    number of rows"), which it reports one line each on stderr."""
    log_path = os.path.join(work, "compressor.log")
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            start = time.perf_counter()
            # number_of_chunks large enough for every chunk of every room: it
            # stops by itself once no room has uncompressed groups left.
            compressor.compress_state_events_table(url, chunk_size, LEVELS, 10**9)
            seconds = time.perf_counter() - start
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    skipped = Path(log_path).read_text().count("tried to increase the number of rows")
    return seconds, skipped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "small", "large"), default="small")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--chunk-groups",
        type=int,
        default=10_000,
        help="our --chunk-groups, and the compressor's chunk_size (default 10000)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the two databases")
    args = parser.parse_args(argv)
    admin = os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    if not admin:
        raise SystemExit("needs PostgreSQL: run through bench/with-postgres (sets ROOMSTORE_BENCH_POSTGRES)")
    compressor = ensure_compressor()
    ours = create_database(admin, f"rs_bench_compaction_{os.getpid()}")
    theirs = create_database(admin, f"rs_bench_synapse_{os.getpid()}")
    work = tempfile.mkdtemp(prefix="roomstore-bench-compaction-")
    try:
        prepare_roomstore_schema(ours)
        prepare_synapse_schema(theirs)
        t = time.perf_counter()
        info = load_dataset(args.size, roomstore_url=ours, synapse_url=theirs, seed=args.seed)
        print(
            f"dataset {args.size!r} (seed {args.seed}): {len(info.rooms):,} rooms, {info.state_groups:,} state groups,"
            f" {info.rows:,} state rows, loaded into both databases in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
        ours_before = table_figures(ours, "state_group_deltas", OURS_TABLES, full=False)
        theirs_before = table_figures(theirs, "state_groups_state", THEIR_TABLES, full=False)

        print("running the roomstore compaction job (spark-submit --master local[*]) ...", flush=True)
        ours_seconds, summary = run_ours(ours, work, ["--chunk-groups", str(args.chunk_groups)])
        print(f"running synapse_auto_compressor {COMPRESSOR_VERSION} (chunk_size {args.chunk_groups}) ...", flush=True)
        theirs_seconds, skipped = run_theirs(compressor, theirs, args.chunk_groups, work)
        print(f"  it skipped {skipped} chunk(s) it could not shrink (small rooms without snapshots)", flush=True)

        ours_after = table_figures(ours, "state_group_deltas", OURS_TABLES, full=True)
        theirs_after = table_figures(theirs, "state_groups_state", THEIR_TABLES, full=True)

        print("verifying every group's state in both databases ...", flush=True)
        nids = [nid for _, nid in info.rooms]
        ours_check = check_all(info, lambda i: read_roomstore_room(ours, nids[i]))
        theirs_check = check_all(info, lambda i: read_synapse_room(theirs, info.rooms[i][0], info.key_ids))

        mib = 1024 * 1024
        rows = []
        for name, before, after, seconds, (bad, _bad_rooms, longest) in (
            ("roomstore Spark job", ours_before, ours_after, ours_seconds, ours_check),
            (
                f"synapse_auto_compressor {COMPRESSOR_VERSION}",
                theirs_before,
                theirs_after,
                theirs_seconds,
                theirs_check,
            ),
        ):
            rows.append(
                [
                    name,
                    before[0],
                    after[0],
                    f"{after[0] / before[0]:.3f}",
                    f"{before[1] / mib:.1f}",
                    f"{after[1] / mib:.1f}",
                    f"{seconds:.1f}",
                    bad,
                    longest,
                ]
            )
        print()
        print_table(
            [
                "tool",
                "rows before",
                "rows after",
                "after/before",
                "MiB before",
                "MiB after",
                "wall s",
                "mismatched groups",
                "max hops",
            ],
            rows,
        )
        print()
        print(
            f"levels {LEVELS} (hop bound {levels_hop_bound([int(x) for x in LEVELS.split(',')])});"
            f" rows: delta rows (state_group_deltas / state_groups_state); MiB: all state tables with"
            " indexes, after VACUUM FULL ANALYZE"
        )
        print(
            f"rows after, ours / theirs: {ours_after[0] / theirs_after[0]:.3f}"
            f" ({'<=' if ours_after[0] <= theirs_after[0] else '>'} theirs);"
            f" wall time, ours / theirs: {ours_seconds / theirs_seconds:.2f}"
        )
        timings = summary.get("timings_s", {})
        print(
            f"our job's own figures: {summary['totals']['rooms']} rooms, {timings.get('read_and_plan', 0):.1f}s"
            f" read+plan+verify, {timings.get('write', 0):.1f}s staging+swaps, {summary['duration_s']:.1f}s in the"
            f" driver; the rest of the wall time is spark-submit/JVM start-up"
        )
        if ours_check[0] or theirs_check[0]:
            print(
                f"MISMATCHES: ours {ours_check[0]} group(s) in {ours_check[1]} room(s);"
                f" theirs {theirs_check[0]} group(s) in {theirs_check[1]} room(s)"
            )
    finally:
        if not args.keep:
            import psycopg2

            conn = psycopg2.connect(admin)
            conn.autocommit = True
            with conn.cursor() as cur:
                for url in (ours, theirs):
                    name = urllib.parse.urlsplit(url).path.lstrip("/")
                    cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
                    cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.close()
        else:
            print(f"kept: {ours} {theirs}")


if __name__ == "__main__":
    main()
