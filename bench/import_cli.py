"""``roomstore import`` as a user runs it, against an older tree of the code,
and beside the same events persisted in process (issue 42).

usage: bench/with-postgres .venv/bin/python bench/import_cli.py [--baseline DIR] [--rooms 25]
       [--events-per-room 1000] [--runs 3] [--engines sqlite,postgres] [--synapse]

The history is ``roomstore generate-sample FILE --rooms N --events-per-room M
--seed 7`` (membership churn, forks that merge, redactions, history
visibility changes; rooms of versions 12, 11, 9, 10 and 6). With
``--baseline DIR`` (a checkout of an older commit, e.g. ``git worktree add
/tmp/base 4d1a46f``), the lines that tree cannot store at all (a room
version it does not know) are dropped first, found by importing the file
once with it, so both trees import the same events: with 25 rooms that
leaves 20 rooms, about 20,000 lines.

Each import is the command a user runs, ``python -m roomstore.cli import
FILE --db URL`` with default options, in a subprocess whose ``PYTHONPATH``
is the tree measured, into a fresh database; the trees take turns in each
round, so the machine's load falls on both alike. Per run: events/s by the
import's own ``seconds`` (the events' import, not the process start) and
the CPU seconds of the process and its workers (``RUSAGE_CHILDREN``), which
load on a shared machine disturbs less than wall time. Medians per tree and
engine, and this tree's over the baseline's as ratios.

``--synapse``: also a history a real Synapse made through its client API
(``tests/synapse_db/history.py``, started from ``.venv-synapse``: three
rooms, membership changes, redactions, a forked DAG, a few hundred events),
read back from its database as JSON lines, measured the same way.

The in-process figure: the same lines through ``roomstore.cli.import_loop.
import_file`` into a ``RoomStore`` opened in this process (default options
but ``--validation-processes``: none), the figure ``bench/event_store.py``
style measurements give, printed beside the CLI's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._common import bench_databases, print_table  # noqa: E402


def cli(tree: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.run(
        [sys.executable, "-c", "from roomstore.cli import main; main()", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=tree,  # python -c puts the working directory first on sys.path, before PYTHONPATH
    )


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def import_once(tree: str, path: str, url: str, expected: int) -> tuple[float, float]:
    """(events/s, CPU seconds) of one CLI import into a fresh database."""
    cpu = children_cpu()
    done = cli(tree, "import", path, "--db", url)
    cpu = children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"import with {tree} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    summary = json.loads(done.stdout.splitlines()[-1])
    if summary["imported"] + summary["already_present"] != expected or summary["failed"]:
        raise SystemExit(f"{tree}: expected {expected:,} imported and none failed: {summary}")
    return summary["imported"] / summary["seconds"], cpu


def common_lines(baseline: str, path: str, directory: str, label: str) -> str:
    """``path`` without the lines ``baseline`` refuses (rooms of versions it does not know)."""
    done = cli(baseline, "import", path, "--db", "sqlite:///" + os.path.join(directory, f"probe-{label}.db"))
    if done.returncode != 0:
        raise SystemExit(f"the baseline could not import at all: {done.stderr.strip()[-500:]}")
    refused = {json.loads(line)["line"] for line in done.stdout.splitlines() if '"error"' in line}
    kept = os.path.join(directory, f"common-{label}.jsonl")
    with open(path, "rb") as source, open(kept, "wb") as out:
        for number, line in enumerate(source, start=1):
            if number not in refused:
                out.write(line)
    return kept


def in_process_child(path: str, url: str) -> float:
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--in-process", path, url],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if done.returncode != 0:
        raise SystemExit(f"in-process import failed: {done.stderr.strip()[-500:]}")
    return float(done.stdout.split()[-1])


def measure(label: str, trees: dict[str, str], path: str, events: int, new_url, runs: int) -> list[tuple]:
    """The table's rows for one history on one engine: each tree's CLI
    import, taking turns, this tree's in process, and the ratios."""
    rates: dict[str, list[float]] = {name: [] for name in trees}
    cpus: dict[str, list[float]] = {name: [] for name in trees}
    inside: list[float] = []
    names = list(trees)
    for round_index in range(runs):
        for name in names if round_index % 2 == 0 else names[::-1]:
            rate, cpu = import_once(trees[name], path, new_url(), events)
            rates[name].append(rate)
            cpus[name].append(cpu)
        inside.append(in_process_child(path, new_url()))
    rows = [
        (label, name, statistics.median(rates[name]), statistics.median(cpus[name]), _runs(rates[name], ",.0f"))
        for name in names
    ]
    rows.append((label, "this tree, in process", statistics.median(inside), "", _runs(inside, ",.0f")))
    if "baseline" in trees:
        ratios = [a / b for a, b in zip(rates["this tree"], rates["baseline"], strict=True)]
        cpu_ratios = [b / a for a, b in zip(cpus["this tree"], cpus["baseline"], strict=True)]
        rows.append(
            (
                label,
                "this/baseline",
                f"{statistics.median(ratios):.2f}x",
                f"{statistics.median(cpu_ratios):.2f}x less",
                _runs(ratios, ".2f"),
            )
        )
    return rows


def _runs(values: list[float], spec: str) -> str:
    return " ".join(format(v, spec) for v in values)


def synapse_made_lines(directory: str) -> str:
    """A history a real Synapse (``.venv-synapse``) made through its client
    API (``tests/synapse_db/history.py``: three rooms, membership changes,
    redactions, a forked DAG), read back from its database as JSON lines."""
    from roomstore.synapse_db.source import SynapseSource
    from tests import synapse_server
    from tests.synapse_db import history

    folder = synapse_server.start()
    try:
        server = synapse_server.SynapseServer(folder)
        history.build(server)
        source = SynapseSource(server.database_url)
        source.connect()
        path = os.path.join(directory, "synapse.jsonl")
        after = None
        with open(path, "wb") as out:
            while page := source.events_page(after, 5000, None):
                for ev in page:
                    out.write(b'{"room_version": "%s", "event": %s}\n' % (ev.room_version.encode(), ev.json))
                after = page[-1].stream_ordering
        source.close()
    finally:
        synapse_server.stop(folder)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="DIR", help="a checkout of the code to compare with")
    parser.add_argument("--rooms", type=int, default=25)
    parser.add_argument("--events-per-room", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", default="sqlite,postgres")
    parser.add_argument(
        "--synapse", action="store_true", help="also a history a real Synapse made (starts one from .venv-synapse)"
    )
    parser.add_argument("--in-process", nargs=2, metavar=("FILE", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        rate: list[float] = []

        async def run(reactor) -> None:
            from roomstore.cli.import_loop import import_file
            from roomstore.store import RoomStore, StoreConfig

            store = await RoomStore.open(args.in_process[1], StoreConfig(), reactor=reactor, create=True)
            try:
                started = time.monotonic()
                summary = await import_file(store, args.in_process[0], in_flight=8)
                rate.append(summary["imported"] / (time.monotonic() - started))
            finally:
                await store.close()

        from twisted.internet import defer, task

        try:
            task.react(lambda reactor: defer.ensureDeferred(run(reactor)))
        except SystemExit:
            pass
        print(f"{rate[0]:.1f}")
        return

    directory = tempfile.mkdtemp(prefix="roomstore-bench-import-")
    generated = os.path.join(directory, "history.jsonl")
    made = cli(
        ROOT,
        "generate-sample",
        generated,
        "--rooms",
        str(args.rooms),
        "--events-per-room",
        str(args.events_per_room),
        "--seed",
        "7",
    )
    if made.returncode != 0:
        raise SystemExit(made.stderr)
    histories = {"generated": generated}
    if args.synapse:
        histories["synapse-made"] = synapse_made_lines(directory)
    trees = {"this tree": ROOT}
    if args.baseline:
        trees["baseline"] = os.path.abspath(args.baseline)
        histories = {label: common_lines(args.baseline, path, directory, label) for label, path in histories.items()}
    wanted = set(args.engines.split(","))
    rows = []
    for label, path in histories.items():
        with open(path, "rb") as handle:
            events = sum(1 for _ in handle)
        print(f"{label} history: {events:,} lines ({path}); {args.runs} rounds, turns alternate")
        for engine, new_url in bench_databases():
            if engine in wanted:
                rows.extend(measure(f"{engine}, {label}", trees, path, events, new_url, args.runs))
    print_table(["engine, history", "tree", "events/s (median)", "CPU s (median)", "runs"], rows)
    print("goal (issue 42): this tree's CLI import at least 2.0x the baseline's (4d1a46f) events/s on both engines")


if __name__ == "__main__":
    main()
