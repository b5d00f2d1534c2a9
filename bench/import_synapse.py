"""``roomstore import-synapse`` from a Synapse PostgreSQL database vs
``roomstore import`` of the same events as JSON lines, and peak RSS as the
Synapse database grows.

The Synapse database: a real Synapse (matrix-synapse 1.163.2 from
``.venv-synapse``) is started once on the bench's PostgreSQL, so its own
migrations create the schema, and stopped. Rooms from roomstore's generator
(``roomstore.demo.sample``: rooms at versions 12, 11, 9, 10 and 6, membership
churn, redactions, forks that merge) are then written into Synapse's tables
as Synapse lays them out: ``events``, ``event_json`` (the JSON),
``event_edges``, ``rooms``, ``redactions``, and state groups (a one-row delta on the state before for
each state event, a snapshot where a chain reaches 100 or branches merge,
``event_to_state_groups`` pointing at the state after each event). The last
room ends in a merge whose branches conflict; the bench's "Synapse" resolves
it by taking the first branch, as a homeserver's state resolution would pick
one side, so ``import-synapse`` imports it and ``import`` reports it.

Each import runs as a subprocess (``roomstore.cli``) into a fresh store;
wall time and the child's own peak RSS (``VmHWM`` at its exit; plus its
writer process's, where it has one). The
two commands take turns, ``--runs`` times each, medians printed. Then
``import-synapse`` alone on databases of growing size (a prefix of the same
rooms) for its peak RSS.

    bench/with-postgres .venv/bin/python bench/import_synapse.py [--events 100000] [--runs 3] [--engines sqlite]
        [--baseline DIR]

``--baseline DIR`` (a checkout of older code): ``import-synapse`` with that
code too, in the same turns, and this code's events/s over its.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._common import bench_databases, print_table  # noqa: E402
from roomstore.demo.sample import sample_lines  # noqa: E402

EVENTS_PER_ROOM = 2500
MAX_CHAIN = 100


def synapse_schema_database(admin_url: str) -> str:
    """A fresh PostgreSQL database holding the schema a real Synapse made."""
    from tests import synapse_server

    folder = synapse_server.start(admin_url)
    with open(os.path.join(folder, "server.json")) as f:
        url = json.load(f)["database"]
    synapse_server.stop(folder)
    return url


class SynapseLayout:
    """Writes generated rooms into Synapse's tables, with state groups as
    Synapse stores them (see the module docstring)."""

    def __init__(self, url: str):
        import psycopg2

        self.conn = psycopg2.connect(url)
        self.next_group = 1
        self.stream = 0
        self.rows: dict[str, list[tuple]] = collections.defaultdict(list)

    def settle(self) -> None:
        """``VACUUM ANALYZE``: the tables as a Synapse database in use has them
        (its autovacuum long since done). Else autovacuum and the first reads
        of the fresh rows fell on whichever import ran first: 25-33 s against
        9-13 s for the others (session 26's runs), always this tree's first."""
        self.conn.commit()
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
        self.conn.autocommit = False

    def group(self, room_id: str, event_id: str, prev: int | None, rows: dict) -> int:
        group = self.next_group
        self.next_group += 1
        self.rows["state_groups"].append((group, room_id, event_id))
        if prev is not None:
            self.rows["state_group_edges"].append((group, prev))
        self.rows["state_groups_state"].extend((group, room_id, t, k, e) for (t, k), e in rows.items())
        return group

    def add_room(self, version: str, events: list[dict], ids: list[str]) -> None:
        room_id = None
        full: collections.OrderedDict[int, dict] = collections.OrderedDict()  # group -> full state, recent ones
        chain: dict[int, int] = {}  # group -> deltas since its snapshot
        after: dict[str, int] = {}
        for event, event_id in zip(events, ids, strict=True):
            if room_id is None:
                room_id = event.get("room_id") or "!" + event_id[1:]
                self.rows["rooms"].append((room_id, True, event["sender"], version))
            before_groups = list(dict.fromkeys(after[p] for p in event["prev_events"] if p in after))
            for g in before_groups:
                if g is not None:
                    full.move_to_end(g)
            if len(before_groups) == 1:
                before = before_groups[0]
            elif not before_groups:
                before = None
            else:
                merged: dict = {}
                for g in before_groups:  # the first branch wins a conflict
                    for key, value in full[g].items():
                        merged.setdefault(key, value)
                before = self.group(room_id, event_id, None, merged)
                full[before], chain[before] = merged, 0
            key = (event["type"], event["state_key"]) if "state_key" in event else None
            if key is not None:
                state = {**full.get(before, {}), key: event_id}
                if before is None or chain[before] >= MAX_CHAIN:
                    group = self.group(room_id, event_id, None, state)
                    chain[group] = 0
                else:
                    group = self.group(room_id, event_id, before, {key: event_id})
                    chain[group] = chain[before] + 1
                full[group] = state
            else:
                group = before
            after[event_id] = group
            self.stream += 1
            self.rows["events"].append(
                (
                    self.stream,
                    event["depth"],
                    event_id,
                    event["type"],
                    room_id,
                    False,
                    False,
                    event["depth"],
                    event["origin_server_ts"],
                    event["origin_server_ts"],
                    event["sender"],
                    "master",
                    event.get("state_key"),
                )
            )
            self.rows["event_json"].append((event_id, room_id, "{}", json.dumps(event, separators=(",", ":")), 3))
            self.rows["event_to_state_groups"].append((event_id, group))
            self.rows["event_edges"].extend((event_id, p, room_id, False) for p in event["prev_events"])
            if event["type"] == "m.room.redaction":
                redacts = event.get("redacts") or event["content"].get("redacts")
                self.rows["redactions"].append((event_id, redacts, False, event["origin_server_ts"], False))
            while len(full) > 256:  # prev events' groups are recent ones
                full.popitem(last=False)
        self.flush()

    def flush(self) -> None:
        from psycopg2.extras import execute_values

        columns = {
            "rooms": "room_id, is_public, creator, room_version",
            "events": "stream_ordering, topological_ordering, event_id, type, room_id, processed, outlier, depth,"
            " origin_server_ts, received_ts, sender, instance_name, state_key",
            "event_json": "event_id, room_id, internal_metadata, json, format_version",
            "event_to_state_groups": "event_id, state_group",
            "event_edges": "event_id, prev_event_id, room_id, is_state",
            "state_groups": "id, room_id, event_id",
            "state_group_edges": "state_group, prev_state_group",
            "state_groups_state": "state_group, room_id, type, state_key, event_id",
            "redactions": "event_id, redacts, have_censored, received_ts, recheck",
        }
        with self.conn.cursor() as cur:
            for table, cols in columns.items():
                if self.rows.get(table):
                    execute_values(cur, f"INSERT INTO {table} ({cols}) VALUES %s", self.rows[table], page_size=2000)
        self.conn.commit()
        self.rows.clear()


def generated_rooms(total_events: int):
    """(room version, events, event IDs) per generated room."""
    from roomstore.pdu.hashing import compute_event_id
    from roomstore.pdu.room_versions import get_room_version

    rooms = max(1, total_events // EVENTS_PER_ROOM)
    current: list = []
    version = None
    for line in sample_lines(rooms=rooms, events_per_room=EVENTS_PER_ROOM, seed=11):
        obj = json.loads(line)
        event = obj["event"] if "event" in obj and isinstance(obj.get("event"), dict) else obj
        if event["type"] == "m.room.create" and event.get("state_key") == "":
            if current:
                yield version, current
            version, current = event["content"].get("room_version", "1"), []
        current.append((event, compute_event_id(get_room_version(version), event)))
    if current:
        yield version, current


#: Runs ``roomstore.cli`` and, at exit, writes its own peak RSS (``VmHWM``:
#: this process's memory only; ``wait4``'s ``ru_maxrss`` would also count the
#: parent's memory at spawn time) to the file named in the environment: at
#: ``os._exit``, by which the command leaves since 2026-11-29
#: (``roomstore.processes.leave_now``), or at a normal exit (older trees).
_MEASURED_CLI = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["ROOMSTORE_BENCH_HWM_FILE"], "w") as out:
        out.write(kib)
atexit.register(_peak)
_exit = os._exit
def _measured_exit(code):
    _peak()
    _exit(code)
os._exit = _measured_exit
sys.argv = ["roomstore"] + sys.argv[1:]
runpy.run_module("roomstore.cli", run_name="__main__")
"""


def run_measured(args: list[str], tree: str = ROOT) -> tuple[float, int, list[dict]]:
    """Wall seconds, peak RSS (KiB) and JSON output lines of a roomstore command (of the code in ``tree``).

    The peak RSS is the command's process's plus, where it writes in a
    writer process (``import-synapse`` since 2026-11-29), that process's:
    both hold the store's memory. Validation workers are left out, as before."""
    hwm = tempfile.NamedTemporaryFile(prefix="roomstore-hwm-", delete=False).name
    env = {**os.environ, "PYTHONPATH": tree, "ROOMSTORE_BENCH_HWM_FILE": hwm}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _MEASURED_CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tree,
    )
    writer_peak = _WriterPeak(proc.pid)
    writer_peak.start()
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - started
    writer_peak.stop()
    if proc.returncode != 0:
        raise SystemExit(f"roomstore {args[0]} failed: {stderr.strip()[-500:]}")
    with open(hwm) as f:
        peak = int(f.read()) + writer_peak.kib
    os.remove(hwm)
    return wall, peak, [json.loads(line) for line in stdout.splitlines() if line.strip()]


class _WriterPeak(threading.Thread):
    """The peak RSS (``VmHWM``, KiB) of the writer process under ``pid``,
    polled every 20 ms until ``stop`` (VmHWM only grows, so the last read
    before the process ends is its peak but the last 20 ms)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.kib = 0
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(0.02):
            for child in _children_of(self.pid):
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        if b"roomstore.writer_process.child" not in f.read():
                            continue
                    with open(f"/proc/{child}/status") as f:
                        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
                except (OSError, StopIteration):
                    continue
                self.kib = max(self.kib, kib)

    def stop(self) -> None:
        self._stopped.set()
        self.join()


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="events in the largest Synapse database")
    parser.add_argument("--runs", type=int, default=3, help="runs of each import, taking turns (default 3)")
    parser.add_argument("--engines", default="sqlite", help="roomstore engines to import into (sqlite,postgres)")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="events per call, given to every command (default: none, each tree's own default, as users run it)",
    )
    parser.add_argument("--growth", default="0.25,0.5,1", help="fractions of --events for the RSS-as-it-grows runs")
    parser.add_argument("--growth-only", action="store_true", help="only the RSS-as-it-grows runs")
    parser.add_argument(
        "--baseline", metavar="DIR", help="also import-synapse with the code of this checkout, taking turns"
    )
    args = parser.parse_args()
    admin = os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    if not admin:
        raise SystemExit(
            "needs PostgreSQL for Synapse's database: bench/with-postgres .venv/bin/python bench/import_synapse.py"
        )
    os.chdir(ROOT)
    fractions = sorted(float(f) for f in args.growth.split(","))
    sizes = sorted({max(EVENTS_PER_ROOM, int(args.events * f)) for f in fractions})

    print(
        f"Generating {args.events:,} events and writing Synapse databases of"
        f" {', '.join(f'{s:,}' for s in sizes)} events ..."
    )
    started = time.monotonic()
    rooms = list(generated_rooms(args.events))
    synapse_dbs = {}
    for size in sizes:
        url = synapse_schema_database(admin)
        layout = SynapseLayout(url)
        count = 0
        for version, room in rooms:
            if count >= size:
                break
            layout.add_room(version, [e for e, _ in room], [i for _, i in room])
            count += len(room)
        layout.settle()
        layout.conn.close()
        synapse_dbs[size] = (url, count)
    largest_url, largest_count = synapse_dbs[sizes[-1]]
    print(f"  done in {time.monotonic() - started:.0f} s; largest: {largest_count:,} events in {len(rooms)} rooms")

    engines = [e for e in bench_databases() if e[0] in args.engines.split(",")]
    if not args.growth_only:
        compare(args, engines, largest_url, largest_count)
    growth(args, engines[0], sizes, synapse_dbs)


def compare(args, engines, largest_url: str, largest_count: int) -> None:
    """Both commands on the largest database, taking turns."""
    # The same events as JSON lines, read back from the Synapse database.
    from roomstore.synapse_db.source import SynapseSource

    lines_path = os.path.join(tempfile.mkdtemp(prefix="roomstore-bench-"), "synapse.jsonl")
    source = SynapseSource(largest_url)
    source.connect()
    after = None
    with open(lines_path, "wb") as out:
        while page := source.events_page(after, 5000, None):
            for ev in page:
                out.write(b'{"room_version": "%s", "event": %s}\n' % (ev.room_version.encode(), ev.json))
            after = page[-1].stream_ordering
    source.close()

    rows = []
    for engine, new_url in engines:
        samples: dict[str, list] = {"import-synapse": [], "import": []}
        if args.baseline:
            samples["import-synapse (baseline)"] = []
        for _ in range(args.runs):
            for command in samples:
                target = new_url()
                if command.startswith("import-synapse"):
                    cmd = ["import-synapse", "--from", largest_url, "--db", target, *batch_option(args)]
                else:
                    cmd = ["import", lines_path, "--db", target, *batch_option(args)]
                wall, rss, out = run_measured(cmd, args.baseline if command.endswith("(baseline)") else ROOT)
                summary = out[-1]
                stored = summary.get("events", summary.get("imported"))
                samples[command].append((wall, rss, stored))
        for command, runs in samples.items():
            walls = [w for w, _, _ in runs]
            stored = runs[0][2]
            rows.append(
                (
                    engine,
                    command,
                    stored,
                    statistics.median(walls),
                    stored / statistics.median(walls),
                    statistics.median(r for _, r, _ in runs) / 1024,
                    ", ".join(f"{w:.1f}" for w in walls),
                )
            )
        rate = {row[1]: row[4] for row in rows if row[0] == engine}
        rows.append((engine, "ratio import-synapse / import", "", "", rate["import-synapse"] / rate["import"], "", ""))
        if args.baseline:
            ratio = rate["import-synapse"] / rate["import-synapse (baseline)"]
            rows.append((engine, "ratio import-synapse / baseline", "", "", ratio, "", ""))
    print(f"\nImport of {largest_count:,} events: medians of {args.runs} runs, the two commands taking turns")
    print_table(["engine", "command", "events stored", "wall s", "events/s", "peak RSS MiB", "runs (s)"], rows)


def batch_option(args) -> list[str]:
    """``--batch-size N`` where the bench was given one; else nothing: each tree's default."""
    return [] if args.batch_size is None else ["--batch-size", str(args.batch_size)]


def growth(args, engine_and_url, sizes, synapse_dbs) -> None:
    """``import-synapse``'s peak RSS on databases of growing size."""
    growth = []
    engine, new_url = engine_and_url
    for size in sizes:
        url, count = synapse_dbs[size]
        wall, rss, out = run_measured(["import-synapse", "--from", url, "--db", new_url(), *batch_option(args)])
        growth.append(
            (
                f"{count:,}",
                out[-1]["events"],
                out[-1]["states_from_synapse"],
                wall,
                out[-1]["events"] / wall,
                rss / 1024,
            )
        )
    print(f"\nimport-synapse's peak RSS as the Synapse database grows ({engine})")
    print_table(
        ["Synapse events", "events stored", "states from Synapse", "wall s", "events/s", "peak RSS MiB"], growth
    )


if __name__ == "__main__":
    main()
