"""Benchmark: one room larger than memory, compacted with 1 GiB JVMs.

Generates ONE room with heavy membership churn (``bench/dataset.py``:
6,000 users, 150 of them hot, forks, persist-time snapshots every 100 hops) at
several sizes (default about 1M, 2.5M and 5.2M state rows), and for each size

* loads it into roomstore's tables and into Synapse-shaped tables (two
  PostgreSQL databases, the same groups under the same ids);
* runs ``bin/roomstore-compact`` on a Spark standalone cluster started here on
  loopback (a master and one worker, from pyspark's ``spark-class``), with
  ``--driver-memory`` and ``--executor-memory`` at 1 GiB, sampling every
  process of the job (spark-submit's JVM, the driver's Python, the worker's
  executor JVM, the Python workers) and of the cluster (master, worker) from
  ``/proc``: the peak RSS (``VmHWM``) of each, by role;
* runs synapse_auto_compressor 0.1.2 on the same room in a child process
  (its peak RSS from ``wait4``'s ``ru_maxrss``, and its wall time);
* verifies every group of both databases against the generator's groups.

    bench/with-postgres .venv/bin/python bench/compaction_memory.py [--groups 26000,50500,95000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
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
from bench.dataset import (  # noqa: E402
    RoomShape,
    load_dataset,
    prepare_roomstore_schema,
    prepare_synapse_schema,
    read_roomstore_room,
    read_synapse_room,
)
from tests.compaction.spark_cluster import SparkCluster  # noqa: E402

MIB = 1024 * 1024


def huge_room(groups: int) -> RoomShape:
    """One room: 6,000 users who join and leave, 150 hot ones (bridges, bots)."""
    return RoomShape("huge", 1, groups, 6_000, 150, 0.35, 0.02, 0.01)


# ---------------------------------------------------------------------------
# peak memory of process trees, from /proc


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(roots: list[int]) -> list[int]:
    tree = _children()
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def role_of(cmdline: str) -> str:
    if "deploy.master.Master" in cmdline:
        return "cluster master JVM"
    if "deploy.worker.Worker" in cmdline:
        return "cluster worker JVM"
    if "CoarseGrainedExecutorBackend" in cmdline:
        return "executor JVM"
    if "org.apache.spark.deploy.SparkSubmit" in cmdline:
        return "driver JVM (spark-submit)"
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline or "pyspark/daemon" in cmdline:
        return "Python workers (executor side)"
    if "spark_job.py" in cmdline or "roomstore.compaction" in cmdline:
        return "driver Python"
    if "synapse_auto_compressor" in cmdline:
        return "synapse_auto_compressor"
    # Short-lived helpers (Spark's cleanup ``rm -rf <temp dir>``, shells):
    # the program's name, so one role covers every run's.
    program = cmdline.split()[0].rsplit("/", 1)[-1] if cmdline.split() else "?"
    return f"other ({program})"


class PeakSampler:
    """Polls the process trees under ``roots()`` and keeps each process's VmHWM."""

    def __init__(self, roots, interval: float = 0.2) -> None:
        self.roots = roots
        self.interval = interval
        self.peaks: dict[int, tuple[str, int]] = {}  # pid -> (role, peak bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for pid in _descendants(self.roots()):
            try:
                with open(f"/proc/{pid}/status") as fh:
                    status = fh.read()
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            if not hwm:
                continue
            role = role_of(cmdline)
            old = self.peaks.get(pid)
            if old is None or hwm > old[1]:
                self.peaks[pid] = (role, hwm)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (processes seen, largest peak RSS in bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for role, peak in self.peaks.values():
            count, top = out.get(role, (0, 0))
            out[role] = (count + 1, max(top, peak))
        return out


# ---------------------------------------------------------------------------
# the two tools


def run_ours(
    url: str,
    cluster: SparkCluster,
    memory: str,
    chunk_groups: int,
    work: str,
    target: str = "--db",
    extra: tuple[str, ...] = (),
):
    """(wall seconds, role -> (processes, peak bytes)) of the job on the cluster; ``target``: ``--db`` or
    ``--synapse``; ``extra``: more job options (``--summary-json PATH``)."""
    log_path = os.path.join(work, "job.log")
    cmd = [
        str(ROOT / "bin" / "roomstore-compact"),
        "--master",
        cluster.url,
        *cluster.submit_options(memory),
        "--driver-memory",
        memory,
        target,
        url,
        "--levels",
        LEVELS,
        "--chunk-groups",
        str(chunk_groups),
        *extra,
    ]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        with PeakSampler(lambda: [proc.pid, *cluster.daemon_pids()]) as sampler:
            status = proc.wait()
        seconds = time.perf_counter() - start
    if status != 0:
        print(Path(log_path).read_text()[-4000:])
        raise SystemExit(f"the compaction job failed (exit {status}); log above")
    return seconds, sampler.by_role()


def run_theirs(url: str, chunk_size: int, work: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of synapse_auto_compressor in a child process."""
    code = (
        "import sys, synapse_auto_compressor as c;"
        " c.compress_state_events_table(sys.argv[1], int(sys.argv[2]), sys.argv[3], 10**9)"
    )
    with open(os.path.join(work, "compressor.log"), "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", code, url, str(chunk_size), LEVELS], stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"synapse_auto_compressor failed (exit {proc.returncode}); see {work}/compressor.log")
    return seconds, usage.ru_maxrss * 1024


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--groups",
        default="26000,50500,95000",
        help="state groups of the room, one size per comma (default: ~1M, 2.5M, 5.2M rows)",
    )
    parser.add_argument("--memory", default="1g", help="driver and executor memory (default 1g)")
    parser.add_argument("--chunk-groups", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    admin = os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    if not admin:
        raise SystemExit("needs PostgreSQL: run through bench/with-postgres (sets ROOMSTORE_BENCH_POSTGRES)")
    ensure_compressor()
    rows_out = []
    roles_seen: list[str] = []
    per_size: list[tuple[int, dict[str, tuple[int, int]]]] = []
    print(f"load average at start: {load_average()} ({os.cpu_count()} cores)", flush=True)
    with SparkCluster(workers=1, cores=2, memory=args.memory) as cluster:
        print(
            f"Spark standalone cluster at {cluster.url} (1 worker, 2 cores, {args.memory}); "
            f"executor Python {cluster.python}",
            flush=True,
        )
        for n, groups in enumerate(int(g) for g in args.groups.split(",")):
            work = tempfile.mkdtemp(prefix="roomstore-bench-memory-")
            ours = create_database(admin, f"rs_bench_memory_{os.getpid()}_{n}")
            theirs = create_database(admin, f"rs_bench_memory_syn_{os.getpid()}_{n}")
            prepare_roomstore_schema(ours)
            prepare_synapse_schema(theirs)
            t = time.perf_counter()
            info = load_dataset(roomstore_url=ours, synapse_url=theirs, seed=args.seed, shapes=[huge_room(groups)])
            print(
                f"room of {info.state_groups:,} groups, {info.rows:,} state rows: loaded into both databases in"
                f" {time.perf_counter() - t:.0f}s",
                flush=True,
            )
            before = table_figures(ours, "state_group_deltas", ["state_group_deltas", "state_groups"], full=False)
            load_ours = load_average()
            ours_s, roles = run_ours(ours, cluster, args.memory, args.chunk_groups, work)
            print(f"  roomstore job: {ours_s:.0f}s; load average before {load_ours}", flush=True)
            load_theirs = load_average()
            theirs_s, theirs_peak = run_theirs(theirs, args.chunk_groups, work)
            print(
                f"  synapse_auto_compressor: {theirs_s:.0f}s, peak RSS {theirs_peak / MIB:.0f} MiB;"
                f" load average before {load_theirs}",
                flush=True,
            )
            after_ours = table_figures(ours, "state_group_deltas", ["state_group_deltas"], full=False)[0]
            after_theirs = table_figures(theirs, "state_groups_state", ["state_groups_state"], full=False)[0]
            ours_bad = check_all(info, lambda i: read_roomstore_room(ours, info.rooms[i][1]))
            theirs_bad = check_all(info, lambda i: read_synapse_room(theirs, info.rooms[i][0], info.key_ids))
            print(
                f"  verified all {info.state_groups:,} groups: mismatched ours {ours_bad[0]}, theirs"
                f" {theirs_bad[0]}; max hops ours {ours_bad[2]}, theirs {theirs_bad[2]}",
                flush=True,
            )
            for role in roles:
                if role not in roles_seen:
                    roles_seen.append(role)
            per_size.append((info.rows, roles))
            print(
                "  peak RSS MiB by role: "
                + ", ".join(f"{role} {peak / MIB:.0f} ({count})" for role, (count, peak) in sorted(roles.items())),
                flush=True,
            )
            rows_out.append(
                [
                    f"{info.rows:,}",
                    f"{info.state_groups:,}",
                    before[0],
                    after_ours,
                    after_theirs,
                    f"{ours_s:.0f}",
                    f"{theirs_s:.0f}",
                    f"{max(p for _, p in roles.values()) / MIB:.0f}",
                    f"{theirs_peak / MIB:.0f}",
                    f"{ours_bad[0]} / {theirs_bad[0]}",
                ]
            )
            for url in (ours, theirs):
                drop(admin, url)
    print()
    print(
        f"driver and executor memory {args.memory}, --chunk-groups {args.chunk_groups}, levels {LEVELS};"
        f" synapse_auto_compressor {COMPRESSOR_VERSION} with chunk_size {args.chunk_groups}"
    )
    print()
    print_table(
        [
            "room rows",
            "groups",
            "rows before",
            "after: ours",
            "after: theirs",
            "ours s",
            "theirs s",
            "ours peak MiB (largest process)",
            "theirs peak MiB",
            "mismatched ours / theirs",
        ],
        rows_out,
    )
    print()
    print("peak RSS (VmHWM) by process role, MiB (largest process of the role; processes seen):")
    print_table(
        ["role"] + [f"{rows:,} rows" for rows, _ in per_size],
        [
            [role]
            + [f"{roles[role][1] / MIB:.0f} ({roles[role][0]})" if role in roles else "-" for _, roles in per_size]
            for role in roles_seen
        ],
    )
    print(f"load average at end: {load_average()}")


def drop(admin: str, url: str) -> None:
    import urllib.parse

    import psycopg2

    name = urllib.parse.urlsplit(url).path.lstrip("/")
    conn = psycopg2.connect(admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()


if __name__ == "__main__":
    main()
