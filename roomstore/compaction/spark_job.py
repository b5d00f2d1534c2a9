"""The state-group compaction job: ``spark-submit [options] spark_job.py --db URL ...``.

Usually started through ``bin/roomstore-compact``, which builds the
``spark-submit`` line (see :func:`submit_main`); docs/compaction.md is the
operator's guide. What happens:

1. The driver takes the compaction lock and starts or resumes a run
   (:mod:`roomstore.compaction.writer`): ``snapshot_max`` = MAX(state_group)
   at start; nothing above it is read or written.
2. Rooms with more than ``--chunk-groups`` groups are cut into chunks of
   that many groups in id order; one driver-side statement returns the first
   group of each chunk and every predecessor link that crosses into an
   earlier chunk (about one per chunk). Spark reads those predecessors' full
   states (one recursive statement, :func:`boundary_states_sql`) and reads
   ``state_groups`` and ``state_group_deltas`` over JDBC (PostgreSQL, or
   SQLite through the xerial driver), partitioned on ``state_group`` between
   MIN and MAX. Rows are sorted by ``sort_id`` (the group id; for boundary
   states the first group of the chunk that needs them), so a chunk's
   boundary states arrive just before its groups.
3. ``groupBy(room).applyInArrow`` with the *iterator* form runs one
   :class:`RoomCompactor` per room over Arrow batches sorted by (chunk, id):
   the room is fed to :class:`~roomstore.compaction.StreamingCompactor` chunk by
   chunk, so a Python worker holds one chunk plus the compactor's bounded
   carry-over, never the room. For every chunk the job rebuilds the groups
   from the rows it is about to write and checks with
   :func:`~roomstore.compaction.verify` that every group's full state is the
   same under the old and the new representation. A room with any mismatch
   is reported and not written.
4. The driver streams the per-chunk results, stages each room's new rows and
   swaps its chunks in, one short transaction each (re-checking that nothing
   changed underneath), recording progress in the same transaction.

Everything the executors run is in :class:`RoomCompactor` and
:func:`make_room_function` (pure Python plus numpy/pyarrow, no database).
Importing this module does not start Spark.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import sys
import time
import traceback
import urllib.parse
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np
import pyarrow as pa

from roomstore.compaction import (
    DEFAULT_LEVELS,
    DEFAULT_WINDOW,
    StateGroupEntry,
    StreamingCompactor,
    levels_hop_bound,
    verify,
)
from roomstore.compaction.writer import (
    DEFAULT_HEARTBEAT_SECONDS,
    DEFAULT_STALE_LOCK_SECONDS,
    StagedChunk,
    row_checksum_np,
)

log = logging.getLogger("roomstore.compaction")

APP_NAME = "roomstore-state-compaction"
DEFAULT_CHUNK_GROUPS = 10_000
#: Exit codes: 2 = finished, but rooms failed verification or raised errors
#: (they were left untouched); 75 (EX_TEMPFAIL) = another job holds the lock.
EXIT_ROOMS_FAILED = 2
EXIT_LOCKED = 75

#: Columns of the rows fed to the per-room function; -1 stands for NULL.
#: ``sort_id`` orders a room's rows (see the module docstring); ``kind`` 0 =
#: a boundary state row (``state_group`` is the boundary group;
#: a row with ``type_key_nid`` -1 marks the state as complete, so empty states
#: are represented), 1 = a delta row of a group of the chunk (one row with
#: ``type_key_nid`` -1 for a group without rows).
INPUT_COLUMNS = ("sort_id", "kind", "state_group", "prev_state_group", "chain_length", "type_key_nid", "event_nid")

#: One output row per chunk (Spark DDL). The blobs are int64 arrays
#: (little-endian, C order): groups (n, 7), refs (k,), deltas (m, 3); see
#: :class:`ChunkResult`. They are empty in dry runs and for chunks without
#: changes.
OUTPUT_SCHEMA = (
    "room_nid long, first_group long, last_group long, is_last boolean, status string, detail string, "
    "state_groups long, rows_before long, rows_after long, rewritten long, chain_updates long, missing long, "
    "mismatched long, max_depth long, boundary long, groups_blob binary, refs_blob binary, deltas_blob binary"
)
_OUTPUT_FIELDS = [f.strip().split(" ")[0] for f in OUTPUT_SCHEMA.split(",")]
_ARROW_OUTPUT = pa.schema(
    [
        (name, pa.bool_() if name == "is_last" else pa.string() if name in ("status", "detail")
         else pa.binary() if name.endswith("_blob") else pa.int64())
        for name in _OUTPUT_FIELDS
    ]
)

#: Rewrite an event id to this much above itself to corrupt a plan (tests).
_FAULT_OFFSET = 10**12


# ---------------------------------------------------------------------------
# options


def parse_levels(text: str) -> Tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"levels must be comma-separated integers, not {text!r}") from None
    if not levels or any(size < 1 for size in levels):
        raise argparse.ArgumentTypeError("levels must be positive chain lengths, e.g. 100,50,25")
    return levels


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job options")
    job.add_argument("--db", required=True, help="database URL: postgresql://user@host:port/db or sqlite:///path")
    job.add_argument(
        "--rooms",
        help="comma-separated room IDs, or largest:N for the N rooms with the most state groups (default: all)",
    )
    job.add_argument("--levels", type=parse_levels, default=DEFAULT_LEVELS, help="level sizes (default 100,50,25)")
    job.add_argument(
        "--max-hops", type=int, default=None,
        help="longest predecessor chain allowed after compaction (default: sum(level - 1), 172 for the default)",
    )
    job.add_argument(
        "--min-saving", type=int, default=1, help="leave a room alone unless it saves at least this many rows (default 1)"
    )
    job.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")
    job.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    job.add_argument(
        "--chunk-groups", type=int, default=DEFAULT_CHUNK_GROUPS,
        help=f"state groups per chunk: bounds a worker's memory (default {DEFAULT_CHUNK_GROUPS}; 0: whole rooms)",
    )
    job.add_argument("--summary-json", metavar="PATH", help="write the run summary as JSON here")
    job.add_argument("--metrics-file", metavar="PATH", help="write Prometheus text-format figures here (atomically)")
    job.add_argument("--strategy", choices=("smart", "levels"), default="smart", help="compaction strategy (default smart)")
    job.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="recent groups considered as bases (smart)")
    job.add_argument("--read-partitions", type=int, default=0, help="JDBC read partitions (default: automatic)")
    job.add_argument("--shuffle-partitions", type=int, default=0, help="partitions rooms are spread over (default: automatic)")
    job.add_argument(
        "--lock-timeout", type=float, default=DEFAULT_STALE_LOCK_SECONDS,
        help="seconds after which another job's lock heartbeat counts as stale (default 600)",
    )
    job.add_argument(
        "--heartbeat", type=float, default=DEFAULT_HEARTBEAT_SECONDS, help="seconds between lock heartbeats (default 30)"
    )
    # Test-only knobs, deliberately undocumented in --help.
    job.add_argument("--inject-fault-room", help=argparse.SUPPRESS)
    job.add_argument("--swap-delay", type=float, default=0.0, help=argparse.SUPPRESS)


def _add_submit_options(parser: argparse.ArgumentParser) -> None:
    spark = parser.add_argument_group("spark-submit options (bin/roomstore-compact only)")
    spark.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    spark.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark configuration")
    spark.add_argument("--driver-memory", help="e.g. 2g")
    spark.add_argument("--executor-memory", help="e.g. 4g")
    spark.add_argument("--executor-cores", help="cores per executor")
    spark.add_argument("--num-executors", help="executors (YARN/Kubernetes)")
    spark.add_argument("--deploy-mode", choices=("client",), help="only client mode: the driver writes to the database")
    spark.add_argument(
        "--driver-java-options", action="append", default=[], metavar="OPTS",
        help="extra JVM options for the driver (kept together with the wrapper's quiet log4j setting); e.g."
        " -XX:TieredStopAtLevel=1 starts short local runs faster",
    )
    spark.add_argument("--jdbc-jar", action="append", default=[], metavar="JAR", help="JDBC driver jar (default: by URL)")
    spark.add_argument("--spark-submit", help="spark-submit to run (default: the one shipped with pyspark)")
    spark.add_argument("--print-command", action="store_true", help="print the spark-submit line and exit")


def job_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spark_job.py",
        description="Compact roomstore state groups (run through spark-submit; see docs/compaction.md).",
        allow_abbrev=False,
    )
    _add_job_options(parser)
    return parser


def submit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="roomstore-compact",
        description="Run the roomstore state compaction Spark job (builds the spark-submit line).",
        allow_abbrev=False,
    )
    _add_submit_options(parser)
    _add_job_options(parser)
    return parser


# ---------------------------------------------------------------------------
# bin/roomstore-compact: the spark-submit line

JDBC_JARS = {
    "postgres": ("ROOMSTORE_POSTGRES_JDBC_JAR", "/usr/share/java/postgresql.jar"),
    "sqlite": ("ROOMSTORE_SQLITE_JDBC_JAR", "/usr/share/java/sqlite-jdbc.jar"),
}

_LOG4J2 = """\
# Written by bin/roomstore-compact: Spark at WARN, our job logs its own progress.
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.nativeloader.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativeloader.level = error
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
"""


def _engine_kind(url: str) -> str:
    scheme = url.partition("://")[0].lower()
    return "sqlite" if scheme == "sqlite" else "postgres"


def _cache_dir() -> Path:
    base = os.environ.get("ROOMSTORE_COMPACT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "roomstore-compact"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_py_files_zip(cache: Optional[Path] = None) -> Path:
    """Zip the ``roomstore`` package (plus the pure-Python ``attrs``) for ``--py-files``.

    Executors then need only Python with pyspark's own dependencies (pyarrow,
    numpy, pandas). Named by a hash of the contents, so an unchanged checkout
    reuses the zip.
    """
    import attr
    import attrs as attrs_pkg

    roots = [
        (Path(__file__).resolve().parent.parent, "roomstore"),
        (Path(attr.__file__).resolve().parent, "attr"),
        (Path(attrs_pkg.__file__).resolve().parent, "attrs"),
    ]
    files: List[Tuple[str, Path]] = []
    for root, name in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files.append((f"{name}/{path.relative_to(root).as_posix()}", path))
    digest = hashlib.sha256()
    for arcname, path in files:
        digest.update(arcname.encode())
        digest.update(path.read_bytes())
    target = (cache or _cache_dir()) / f"roomstore-{digest.hexdigest()[:16]}.zip"
    if not target.exists():
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for arcname, path in files:
                info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
        os.replace(tmp, target)
    return target


def build_submit_command(argv: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """The ``spark-submit`` command line and environment for ``argv`` (wrapper options + job options)."""
    parser = submit_parser()
    opts, _ = parser.parse_known_args(argv)
    # Strip the wrapper's own options; everything else goes to the job as given.
    job_args = _strip_submit_options(list(argv))
    cache = _cache_dir()
    log4j = cache / "log4j2.properties"
    if not log4j.exists() or log4j.read_text() != _LOG4J2:
        log4j.write_text(_LOG4J2)
    jars = list(opts.jdbc_jar)
    if not jars:
        env_name, default = JDBC_JARS[_engine_kind(opts.db)]
        jars = [os.environ.get(env_name, default)]
    for jar in jars:
        if not os.path.exists(jar):
            raise SystemExit(
                f"roomstore-compact: JDBC driver jar {jar} not found (Debian: apt-get install "
                f"{'libpostgresql-jdbc-java' if _engine_kind(opts.db) == 'postgres' else 'libxerial-sqlite-jdbc-java'};"
                " or pass --jdbc-jar)"
            )
    zip_path = build_py_files_zip(cache)
    import pyspark

    spark_home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    submit = opts.spark_submit or os.path.join(spark_home, "bin", "spark-submit")
    cmd = [submit, "--master", opts.master, "--name", APP_NAME]
    cmd += ["--jars", ",".join(jars), "--driver-class-path", os.pathsep.join(jars)]
    cmd += ["--py-files", str(zip_path)]
    java_opts = [f"-Dlog4j2.configurationFile=file:{log4j}"] + list(opts.driver_java_options)
    cmd += ["--driver-java-options", " ".join(java_opts)]
    cmd += ["--conf", "spark.ui.showConsoleProgress=false"]
    for flag, value in (
        ("--driver-memory", opts.driver_memory),
        ("--executor-memory", opts.executor_memory),
        ("--executor-cores", opts.executor_cores),
        ("--num-executors", opts.num_executors),
    ):
        if value:
            cmd += [flag, value]
    for conf in opts.conf:
        cmd += ["--conf", conf]
    cmd.append(str(Path(__file__).resolve()))
    cmd += job_args
    env = dict(os.environ)
    env.setdefault("SPARK_HOME", spark_home)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if opts.master.startswith("local"):
        # The host name may resolve to an address Spark cannot bind.
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return cmd, env


_SUBMIT_FLAGS_WITH_VALUE = {
    "--master", "--conf", "--driver-memory", "--executor-memory", "--executor-cores", "--num-executors",
    "--deploy-mode", "--jdbc-jar", "--spark-submit", "--driver-java-options",
}
_SUBMIT_FLAGS = {"--print-command"}


def _strip_submit_options(argv: List[str]) -> List[str]:
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _SUBMIT_FLAGS_WITH_VALUE:
            i += 1 if "=" in arg else 2
            continue
        if name in _SUBMIT_FLAGS:
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def submit_main(argv: Optional[Sequence[str]] = None) -> int:
    """``bin/roomstore-compact``: validate the options, then exec ``spark-submit``.

    exec (not a child process): the wrapper's process becomes spark-submit, so
    signals and the exit status are spark-submit's own.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = submit_parser()
    opts = parser.parse_args(argv)  # --help and bad options stop here, before Spark starts
    from roomstore.storage.engines import DatabaseConfigError, engine_from_url

    try:
        engine_from_url(opts.db, create=False).check_exists()  # a mistyped SQLite path is not a new database
    except DatabaseConfigError as exc:
        sys.stderr.write(f"roomstore-compact: {exc}\n")
        return 2
    cmd, env = build_submit_command(argv)
    if opts.print_command:
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


# ---------------------------------------------------------------------------
# executor side: one room, chunk by chunk


class _StateBank:
    """Original full states of the groups the compactor carries between chunks.

    Stored as one full state (the newest group) plus each other group's
    difference from it: carried groups are recent or level heads, so the
    differences are small and memory stays about one state, not
    ``window + levels`` of them.
    """

    def __init__(self) -> None:
        self.base_id: Optional[int] = None
        self.base: Dict[int, int] = {}
        self.diffs: Dict[int, Dict[int, Optional[int]]] = {}

    def __contains__(self, group_id: int) -> bool:
        return group_id == self.base_id or group_id in self.diffs

    def get(self, group_id: int) -> Optional[Dict[int, int]]:
        """A fresh copy of the group's state, or None if not held."""
        if group_id == self.base_id:
            return dict(self.base)
        diff = self.diffs.get(group_id)
        if diff is None:
            return None
        state = dict(self.base)
        for key, value in diff.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        return state

    def replace(self, base_id: Optional[int], base: Dict[int, int], diffs: Dict[int, Dict[int, Optional[int]]]) -> None:
        self.base_id, self.base, self.diffs = base_id, base, diffs


def _state_diff(state: Mapping[int, int], base: Mapping[int, int]) -> Dict[int, Optional[int]]:
    """``state`` as changes to ``base`` (None: key absent from ``state``)."""
    diff: Dict[int, Optional[int]] = {k: v for k, v in state.items() if base.get(k) != v}
    for key in base:
        if key not in state:
            diff[key] = None
    return diff


class ChunkError(RuntimeError):
    """The input of a room broke the job's assumptions (order, cycles...)."""


@attrs.define
class ChunkResult:
    """What :meth:`RoomCompactor.process_chunk` found for one chunk.

    ``groups`` is an int64 array (n, 7): ``state_group, old_prev, old_rows,
    old_checksum, new_prev, new_chain_length, rewrite`` (-1 prev: snapshot);
    ``refs`` the groups outside the chunk that rewritten groups now hang off;
    ``deltas`` (m, 3): ``state_group, type_key_nid, event_nid`` (-1 event:
    tombstone) of the rewritten groups. ``mismatched`` lists groups whose full
    state would change (must be empty to write); ``missing`` maps groups
    whose chain reaches an absent group to that group (left unchanged).
    """

    first_group: int
    last_group: int
    state_groups: int
    rows_before: int
    rows_after: int
    rewritten: int
    chain_updates: int
    max_depth: int
    boundary: int
    missing: Dict[int, int]
    mismatched: List[int]
    groups: np.ndarray
    refs: np.ndarray
    deltas: np.ndarray

    @property
    def has_changes(self) -> bool:
        return bool(self.rewritten or self.chain_updates)

    def to_staged(self, room_nid: int) -> StagedChunk:
        """The writer's form (Python ints, None for NULL)."""
        groups = [
            (g, None if op < 0 else op, rows, ck, None if np_ < 0 else np_, chain, rw)
            for g, op, rows, ck, np_, chain, rw in self.groups.tolist()
        ]
        deltas = [(g, k, None if e < 0 else e) for g, k, e in self.deltas.tolist()]
        return StagedChunk(
            room_nid=room_nid,
            first_group=self.first_group,
            last_group=self.last_group,
            groups=groups,
            refs=self.refs.tolist(),
            deltas=deltas,
            rows_before=self.rows_before,
            rows_after=self.rows_after,
            groups_rewritten=self.rewritten,
        )


def _empty(shape_cols: int) -> np.ndarray:
    return np.zeros((0, shape_cols), dtype=np.int64) if shape_cols else np.zeros(0, dtype=np.int64)


class RoomCompactor:
    """Compacts and verifies one room, fed chunk by chunk (executor side).

    Feed :meth:`process_chunk` the room's chunks in order (arrays as in
    :data:`INPUT_COLUMNS`, boundary rows first, group rows sorted by id then
    key). Memory: the current chunk, the compactor's carry-over, and the
    carried groups' states in a :class:`_StateBank` (about one full state).

    ``emit=False`` (dry runs) skips building the arrays to write; ``fault``
    corrupts one delta row of the first chunk that rewrites anything, after
    planning and before verification (tests prove such a room is refused).
    """

    def __init__(
        self,
        room_nid: int,
        *,
        strategy: str = "smart",
        levels: Sequence[int] = DEFAULT_LEVELS,
        max_hops: Optional[int] = None,
        window: int = DEFAULT_WINDOW,
        emit: bool = True,
        fault: bool = False,
    ) -> None:
        self.room_nid = room_nid
        self.emit = emit
        self.fault = fault
        self._boundary: Dict[int, Dict[int, int]] = {}
        self._bank = _StateBank()
        self._depth: Dict[int, int] = {}  # new chain length of carried groups
        self._last_group = -1
        self.compactor = StreamingCompactor(
            strategy, levels=levels, max_hops=max_hops, window=window, resolve_state=self._resolve
        )

    def _resolve(self, group_id: int) -> Optional[Mapping[int, int]]:
        # The compactor asks only for predecessors it does not carry; every
        # predecessor across a chunk boundary was read as a boundary state.
        return self._boundary.get(group_id)

    def _known_state(self, group_id: int) -> Optional[Dict[int, int]]:
        state = self._bank.get(group_id)
        if state is None and group_id in self._boundary:
            state = dict(self._boundary[group_id])
        return state

    # -- parsing ------------------------------------------------------------

    @staticmethod
    def _parse_boundary(sg: np.ndarray, tk: np.ndarray, ev: np.ndarray) -> Dict[int, Dict[int, int]]:
        states: Dict[int, Dict[int, int]] = {}
        complete = set()
        for g, k, e in zip(sg.tolist(), tk.tolist(), ev.tolist()):
            if k < 0:
                complete.add(g)
            else:
                states.setdefault(g, {})[k] = e
        return {g: states.get(g, {}) for g in complete}

    def _parse_groups(self, arrays: Mapping[str, np.ndarray], sel: np.ndarray):
        sg = arrays["state_group"][sel]
        prev = arrays["prev_state_group"][sel]
        chain = arrays["chain_length"][sel]
        tk = arrays["type_key_nid"][sel]
        ev = arrays["event_nid"][sel]
        if len(sg) == 0:
            raise ChunkError("a chunk without state groups")
        if np.any(np.diff(sg) < 0) or sg[0] <= self._last_group:
            raise ChunkError("state groups arrived out of order")
        starts = np.flatnonzero(np.r_[True, sg[1:] != sg[:-1]])
        has_row = tk >= 0
        counts = np.add.reduceat(has_row.astype(np.int64), starts)
        sums = np.add.reduceat(np.where(has_row, row_checksum_np(tk, ev), 0), starts)
        ids = sg[starts].tolist()
        prevs = prev[starts].tolist()
        chains = chain[starts].tolist()
        tk_l, ev_l = tk.tolist(), ev.tolist()
        tombstones = bool(np.any(has_row & (ev < 0)))
        bounds = starts.tolist() + [len(sg)]
        entries: List[StateGroupEntry] = []
        for i, gid in enumerate(ids):
            a, z = bounds[i], bounds[i + 1]
            if tk_l[a] < 0:
                delta: Dict[int, Optional[int]] = {}
            elif tombstones:
                delta = {k: (None if e < 0 else e) for k, e in zip(tk_l[a:z], ev_l[a:z])}
            else:
                delta = dict(zip(tk_l[a:z], ev_l[a:z]))
            p = prevs[i]
            entries.append(StateGroupEntry(gid, None if p < 0 else p, delta))
        return entries, prevs, chains, counts, sums

    # -- the chunk ----------------------------------------------------------

    def process_chunk(self, arrays: Mapping[str, np.ndarray]) -> ChunkResult:
        """Plan, check and (unless ``emit`` is off) encode one chunk."""
        kind = arrays["kind"]
        bsel = kind == 0
        self._boundary = self._parse_boundary(
            arrays["state_group"][bsel], arrays["type_key_nid"][bsel], arrays["event_nid"][bsel]
        )
        entries, old_prevs, old_chains, counts, sums = self._parse_groups(arrays, ~bsel)
        self._last_group = entries[-1].group_id
        plan = self.compactor.feed(entries)
        chunk_ids = {e.group_id for e in entries}

        local_depth: Dict[int, int] = {}
        group_rows: List[Tuple[int, ...]] = []
        d_sg: List[int] = []
        d_tk: List[int] = []
        d_ev: List[int] = []
        new_entries: List[StateGroupEntry] = []
        refs = set()
        rewritten = chain_updates = max_depth = 0
        for i, planned in enumerate(plan.entries):
            gid = planned.group_id
            original = entries[i]
            if gid in plan.missing:
                # Unknown state: the row stays exactly as it is.
                new_prev = old_prevs[i]
                new_chain = old_chains[i]
                rewrite = False
            else:
                if planned.prev_group is None:
                    depth = 0
                else:
                    parent = local_depth.get(planned.prev_group)
                    if parent is None:
                        parent = self._depth.get(planned.prev_group)
                    if parent is None:
                        raise ChunkError(f"state group {gid}: new predecessor {planned.prev_group} is unknown")
                    depth = parent + 1
                local_depth[gid] = depth
                max_depth = max(max_depth, depth)
                new_prev = -1 if planned.prev_group is None else planned.prev_group
                new_chain = depth
                rewrite = planned.changed
            if rewrite:
                rewritten += 1
                if planned.prev_group is not None and planned.prev_group not in chunk_ids:
                    refs.add(planned.prev_group)
                delta = dict(planned.delta)
                if self.fault:
                    for key, value in sorted(delta.items()):
                        if value is not None:
                            delta[key] = value + _FAULT_OFFSET
                            self.fault = False
                            break
                for key in sorted(delta):
                    value = delta[key]
                    d_sg.append(gid)
                    d_tk.append(key)
                    d_ev.append(-1 if value is None else value)
                new_entries.append(StateGroupEntry(gid, planned.prev_group, delta))
            else:
                new_entries.append(original)
            if new_chain != old_chains[i]:
                chain_updates += 1
            group_rows.append(
                (gid, old_prevs[i], int(counts[i]), int(sums[i]), new_prev, new_chain, 1 if rewrite else 0)
            )

        # Verify what will be written: the groups outside the chunk that either
        # side builds on enter as snapshots of their (unchanging) full state.
        outside = {e.prev_group for e in entries if e.prev_group is not None and e.prev_group not in chunk_ids}
        outside |= {e.prev_group for e in new_entries if e.prev_group is not None and e.prev_group not in chunk_ids}
        snapshots = []
        for gid in sorted(outside):
            state = self._known_state(gid)
            if state is not None:
                snapshots.append(StateGroupEntry(gid, None, state))
        mismatched = verify(snapshots + entries, snapshots + new_entries)

        self._carry(entries, local_depth)

        if self.emit and (rewritten or chain_updates):
            groups_arr = np.array(group_rows, dtype=np.int64).reshape(-1, 7)
            refs_arr = np.array(sorted(refs), dtype=np.int64)
            deltas_arr = np.array([d_sg, d_tk, d_ev], dtype=np.int64).T.reshape(-1, 3)
        else:
            groups_arr, refs_arr, deltas_arr = _empty(7), _empty(0), _empty(3)
        return ChunkResult(
            first_group=entries[0].group_id,
            last_group=entries[-1].group_id,
            state_groups=len(entries),
            rows_before=plan.rows_before,
            rows_after=plan.rows_after,
            rewritten=rewritten,
            chain_updates=chain_updates,
            max_depth=max_depth,
            boundary=len(self._boundary),
            missing=dict(plan.missing),
            mismatched=list(mismatched),
            groups=groups_arr,
            refs=refs_arr,
            deltas=deltas_arr,
        )

    def _carry(self, entries: Sequence[StateGroupEntry], local_depth: Mapping[int, int]) -> None:
        """Keep the states and depths of the groups the compactor carries on."""
        carried = self.compactor.carried_groups
        by_id = {e.group_id: e for e in entries}
        depth = {}
        for gid in carried:
            d = local_depth.get(gid, self._depth.get(gid))
            if d is not None:
                depth[gid] = d
        if not carried:
            self._bank.replace(None, {}, {})
            self._depth = depth
            return

        def state_of(gid: int) -> Dict[int, int]:
            # Walk the original predecessors back to something known, then
            # apply the deltas forward.
            path = []
            cur: Optional[int] = gid
            base: Optional[Dict[int, int]] = None
            while cur is not None:
                if cur in by_id:
                    path.append(by_id[cur])
                    cur = by_id[cur].prev_group
                    continue
                base = self._known_state(cur)
                if base is None:
                    raise ChunkError(f"state group {gid}: state of carried group's ancestor {cur} unknown")
                break
            state = base if base is not None else {}
            for entry in reversed(path):
                for key, value in entry.delta.items():
                    if value is None:
                        state.pop(key, None)
                    else:
                        state[key] = value
            return state

        newest = max(carried)
        base = state_of(newest)
        diffs = {}
        for gid in carried:
            if gid != newest:
                diffs[gid] = _state_diff(state_of(gid), base)
        self._bank.replace(newest, base, diffs)
        self._depth = depth


def iter_chunks(batches: Iterable[Any], starts: Sequence[int] = ()) -> Iterator[Dict[str, np.ndarray]]:
    """Regroup a room's Arrow batches (sorted by ``sort_id``) into one dict of
    arrays per chunk; ``starts`` are the first groups of chunks 1, 2, ..."""
    import pyarrow.compute as pc

    starts_arr = np.asarray(sorted(starts), dtype=np.int64)

    pending: List[Dict[str, np.ndarray]] = []
    current: Optional[int] = None
    for batch in batches:
        arrays = {
            name: pc.fill_null(batch.column(name), -1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            for name in INPUT_COLUMNS
        }
        if len(arrays["sort_id"]) == 0:
            continue
        chunk = np.searchsorted(starts_arr, arrays["sort_id"], side="right")
        cuts = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        edges = [0] + cuts.tolist() + [len(chunk)]
        for a, z in zip(edges[:-1], edges[1:]):
            c = int(chunk[a])
            if current is not None and c != current:
                if c < current:
                    raise ChunkError("chunks arrived out of order")
                yield _concat(pending)
                pending = []
            current = c
            pending.append({name: arr[a:z] for name, arr in arrays.items()})
    if pending:
        yield _concat(pending)


def _concat(parts: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _detail(result_missing: Mapping[int, int], mismatched: Sequence[int]) -> str:
    parts = []
    if mismatched:
        shown = ", ".join(str(g) for g in mismatched[:20])
        parts.append(f"verification failed for {len(mismatched)} group(s): {shown}")
    if result_missing:
        items = sorted(result_missing.items())[:5]
        shown = ", ".join(f"{g} (reaches missing {m})" for g, m in items)
        parts.append(f"{len(result_missing)} group(s) left as they are, their chain reaches a missing group: {shown}")
    return "; ".join(parts)


def _result_row(room_nid: int, r: ChunkResult, is_last: bool) -> Dict[str, Any]:
    return {
        "room_nid": room_nid,
        "first_group": r.first_group,
        "last_group": r.last_group,
        "is_last": is_last,
        "status": "ok",
        "detail": _detail(r.missing, r.mismatched),
        "state_groups": r.state_groups,
        "rows_before": r.rows_before,
        "rows_after": r.rows_after,
        "rewritten": r.rewritten,
        "chain_updates": r.chain_updates,
        "missing": len(r.missing),
        "mismatched": len(r.mismatched),
        "max_depth": r.max_depth,
        "boundary": r.boundary,
        "groups_blob": r.groups.astype("<i8").tobytes(),
        "refs_blob": r.refs.astype("<i8").tobytes(),
        "deltas_blob": r.deltas.astype("<i8").tobytes(),
    }


def _error_row(room_nid: int, detail: str) -> Dict[str, Any]:
    row = {name: 0 for name in _OUTPUT_FIELDS}
    row.update(room_nid=room_nid, first_group=-1, last_group=-1, is_last=True, status="error", detail=detail,
               groups_blob=b"", refs_blob=b"", deltas_blob=b"")
    return row


def _batch(rows: List[Dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=_ARROW_OUTPUT)


def make_room_function(config: Mapping[str, Any]):
    """The grouped-map function for ``applyInArrow`` (iterator form).

    ``config``: strategy, levels, max_hops, window, emit, fault_room (a
    room_nid or None), starts (room_nid -> chunk start groups, for rooms
    with more than one chunk). Yields one row per chunk; the room's last row has
    ``is_last``; a room that fails yields a final ``status='error'`` row.
    """
    cfg = dict(config)

    def compact_room(key: Tuple[pa.Scalar, ...], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        room_nid = key[0].as_py()
        compactor = RoomCompactor(
            room_nid,
            strategy=cfg["strategy"],
            levels=cfg["levels"],
            max_hops=cfg["max_hops"],
            window=cfg["window"],
            emit=cfg["emit"],
            fault=cfg.get("fault_room") == room_nid,
        )
        held: Optional[ChunkResult] = None
        try:
            for arrays in iter_chunks(batches, cfg.get("starts", {}).get(room_nid, ())):
                result = compactor.process_chunk(arrays)
                if held is not None:
                    yield _batch([_result_row(room_nid, held, False)])
                held = result
        except Exception as exc:
            for _ in batches:  # drain: the worker expects the group consumed
                pass
            detail = f"{type(exc).__name__}: {exc}"
            tb = traceback.format_exc(limit=3).strip().splitlines()
            yield _batch([_error_row(room_nid, detail + " | " + " / ".join(tb[-3:]))])
            return
        if held is not None:
            yield _batch([_result_row(room_nid, held, True)])

    return compact_room


# ---------------------------------------------------------------------------
# reading: SQL shared by the Spark job and the local reference reader


def boundary_states_sql(group_ids: Sequence[int]) -> str:
    """One statement giving the full state of each group in ``group_ids``.

    Rows ``(boundary_group, type_key_nid, event_nid)`` plus one row with NULL
    key per group whose chain is complete (ends at an existing snapshot);
    groups whose chain reaches a missing (purged) group get no rows at all,
    so the job treats them as unknown rather than as a wrong state. Works on
    PostgreSQL and SQLite (recursive CTE, window function).
    """
    if not group_ids:
        raise ValueError("no groups")
    values = ", ".join(f"({int(g)})" for g in group_ids)
    return f"""
WITH RECURSIVE wanted(start_group) AS (VALUES {values}),
chain(start_group, state_group, hops) AS (
    SELECT CAST(start_group AS BIGINT), CAST(start_group AS BIGINT), 0 FROM wanted
    UNION ALL
    SELECT chain.start_group, g.prev_state_group, chain.hops + 1
    FROM state_groups AS g JOIN chain ON g.state_group = chain.state_group
    WHERE g.prev_state_group IS NOT NULL AND chain.hops < 100000
),
complete(start_group) AS (
    SELECT DISTINCT chain.start_group FROM chain JOIN state_groups AS g ON g.state_group = chain.state_group
    WHERE g.prev_state_group IS NULL
)
SELECT start_group AS boundary_group, type_key_nid, event_nid FROM (
    SELECT chain.start_group, d.type_key_nid, d.event_nid,
           ROW_NUMBER() OVER (PARTITION BY chain.start_group, d.type_key_nid ORDER BY chain.hops) AS nearest
    FROM chain JOIN complete ON complete.start_group = chain.start_group
    JOIN state_group_deltas AS d ON d.state_group = chain.state_group
) AS ranked
WHERE nearest = 1 AND event_nid IS NOT NULL
UNION ALL
SELECT start_group, NULL, NULL FROM complete
"""


def read_room_chunks(
    writer: Any, room_nid: int, snapshot_max: int, chunk_groups: int
) -> Iterator[Dict[str, np.ndarray]]:
    """The chunks of one room exactly as the Spark job feeds them, read with
    plain SQL through ``writer`` (a reference for tests and debugging).
    """
    db = writer.db
    where = f"room_nid = {int(room_nid)}"
    starts_by_room, links = writer.chunk_layout(snapshot_max, chunk_groups, where)
    starts = starts_by_room.get(room_nid, [])
    need: Dict[int, List[int]] = {}
    for _, chunk, prev in links:
        need.setdefault(chunk, []).append(prev)
    states: Dict[int, List[Tuple[int, int, int]]] = {}
    all_prevs = sorted({p for prevs in need.values() for p in prevs})
    if all_prevs:
        for g, k, e in db.query(boundary_states_sql(all_prevs)):
            states.setdefault(g, []).append((-1 if k is None else k, -1 if e is None else e))
    groups = db.query(
        "SELECT state_group, prev_state_group, chain_length FROM state_groups"
        " WHERE room_nid = ? AND state_group <= ? ORDER BY state_group",
        (room_nid, snapshot_max),
    )
    deltas: Dict[int, List[Tuple[int, Optional[int]]]] = {}
    for g, k, e in db.query(
        "SELECT d.state_group, d.type_key_nid, d.event_nid FROM state_group_deltas d"
        " JOIN state_groups g ON g.state_group = d.state_group"
        " WHERE g.room_nid = ? AND d.state_group <= ? ORDER BY d.state_group, d.type_key_nid",
        (room_nid, snapshot_max),
    ):
        deltas.setdefault(g, []).append((k, e))
    rows: List[Tuple[int, ...]] = []
    for chunk, prevs in need.items():
        sort_id = 0 if chunk == 0 else starts[chunk - 1]
        for g in sorted(set(prevs)):
            for k, e in sorted(states.get(g, [])):
                rows.append((sort_id, 0, g, -1, -1, k, e))
    for g, p, chain in groups:
        for k, e in deltas.get(g) or [(-1, -1)]:
            rows.append((g, 1, g, -1 if p is None else p, chain, k, -1 if e is None else e))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[5]))
    if not rows:
        return
    cols = np.array(rows, dtype=np.int64).T
    arrays = {name: cols[i] for i, name in enumerate(INPUT_COLUMNS)}
    yield from iter_chunks([pa.RecordBatch.from_pydict(arrays)], starts)


# ---------------------------------------------------------------------------
# the driver


@attrs.define
class JdbcSource:
    """Where Spark reads from: JDBC URL, driver class and connection properties."""

    url: str
    driver: str
    properties: Dict[str, str]
    kind: str

    @classmethod
    def from_db_url(cls, db_url: str) -> "JdbcSource":
        kind = _engine_kind(db_url)
        if kind == "sqlite":
            from roomstore.storage.engines import engine_from_url

            path = os.path.abspath(engine_from_url(db_url).path)
            return cls(f"jdbc:sqlite:{path}", "org.sqlite.JDBC", {}, kind)
        parsed = urllib.parse.urlsplit(db_url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        query.pop("cp_max", None)
        props: Dict[str, str] = {}
        if parsed.username:
            props["user"] = urllib.parse.unquote(parsed.username)
        if parsed.password:
            props["password"] = urllib.parse.unquote(parsed.password)
        props.update(query)
        host = parsed.hostname or "localhost"
        if ":" in host:
            host = f"[{host}]"
        url = f"jdbc:postgresql://{host}:{parsed.port or 5432}{parsed.path}"
        return cls(url, "org.postgresql.Driver", props, kind)

    def read(self, spark: Any, table_sql: str, schema: str, partition: Optional[Tuple[int, int, int]] = None) -> Any:
        reader = (
            spark.read.format("jdbc")
            .option("url", self.url)
            .option("driver", self.driver)
            .option("dbtable", table_sql)
            .option("customSchema", schema)
            .option("fetchsize", "10000")
        )
        for key, value in self.properties.items():
            reader = reader.option(key, value)
        if partition is not None:
            lo, hi, parts = partition
            reader = (
                reader.option("partitionColumn", "state_group")
                .option("lowerBound", str(lo))
                .option("upperBound", str(hi + 1))
                .option("numPartitions", str(max(1, parts)))
            )
        return reader.load()


@attrs.define
class RoomReport:
    """A room's figures as the driver accumulates them from chunk rows."""

    room_nid: int
    room_id: str = ""
    status: str = ""
    state_groups: int = 0
    chunks: int = 0
    rows_before: int = 0
    rows_after: int = 0
    rewritten: int = 0
    chain_updates: int = 0
    missing: int = 0
    mismatched: int = 0
    max_depth: int = 0
    detail: List[str] = attrs.Factory(list)
    error: str = ""
    earlier_attempt: bool = False
    # (first, last, rows_before, rows_after, rewritten, has_changes, already_done, chain_updates)
    chunk_list: List[Tuple[int, int, int, int, int, bool, bool, int]] = attrs.Factory(list)

    @property
    def saving(self) -> int:
        return self.rows_before - self.rows_after

    def as_json(self) -> Dict[str, Any]:
        return {
            "room_id": self.room_id,
            "room_nid": self.room_nid,
            "status": self.status,
            "state_groups": self.state_groups,
            "chunks": self.chunks,
            "rows_before": self.rows_before,
            "rows_after": self.rows_after,
            "rows_saved": self.saving,
            "groups_rewritten": self.rewritten,
            "chain_length_updates": self.chain_updates,
            "max_hops": self.max_depth,
            "missing_groups": self.missing,
            "mismatched_groups": self.mismatched,
            "detail": "; ".join(d for d in self.detail if d) or self.error,
            "earlier_attempt": self.earlier_attempt,
        }


STATUS_WRITTEN = "written"
STATUS_WOULD_WRITE = "would_write"
FAILED_STATUSES = ("mismatch", "error")


class Driver:
    """Runs one compaction (driver side): see the module docstring."""

    def __init__(self, args: argparse.Namespace, out=None) -> None:
        self.args = args
        self.out = out or sys.stdout
        self.levels = tuple(args.levels)
        self.max_hops = args.max_hops if args.max_hops is not None else levels_hop_bound(self.levels)
        self.rooms: Dict[int, RoomReport] = {}
        self.order: List[int] = []
        self.warnings: List[str] = []
        self.timings: Dict[str, float] = {}
        self.total_rooms = 0
        self.done = 0
        self.writer: Any = None
        self.run: Any = None
        self.resumed_rooms: List[RoomReport] = []
        self.chunked_rooms = 0
        self.rows_so_far = [0, 0]
        self.room_names: Dict[int, str] = {}

    # -- output -------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning(text)

    # -- main ---------------------------------------------------------------

    def options(self) -> Dict[str, Any]:
        a = self.args
        return {
            "levels": list(self.levels), "max_hops": self.max_hops, "min_saving": a.min_saving,
            "chunk_groups": a.chunk_groups, "strategy": a.strategy, "window": a.window, "rooms": a.rooms,
        }

    def execute(self) -> int:
        from roomstore.compaction.writer import CompactionWriter, LockHeldError

        a = self.args
        if self.max_hops < 0 or a.chunk_groups < 0 or a.window < 1:
            raise SystemExit("max-hops and chunk-groups must not be negative; window must be at least 1")
        if a.strategy == "levels" and self.max_hops < levels_hop_bound(self.levels):
            raise SystemExit(f"--max-hops {self.max_hops} is below the levels' own bound {levels_hop_bound(self.levels)}")
        started = time.time()
        t0 = time.monotonic()
        self.writer = writer = CompactionWriter(a.db, stale_after_s=a.lock_timeout, heartbeat_s=a.heartbeat)
        spark = None
        status = 0
        try:
            writer.check_schema()
            if not a.dry_run:
                try:
                    writer.acquire_lock()
                except LockHeldError as exc:
                    log.error("%s", exc)
                    return EXIT_LOCKED
            self.run = run = writer.begin_run(self.options(), dry_run=a.dry_run)
            for note in run.warnings:
                self.warn(note)
            mode = "dry run" if a.dry_run else (f"resuming run {run.run_id}" if run.resumed else f"run {run.run_id}")
            self.say(
                f"state compaction ({mode}) on {writer.db.engine.describe()}: snapshot_max={run.snapshot_max},"
                f" levels={','.join(map(str, self.levels))}, max_hops={self.max_hops}, chunk_groups={a.chunk_groups}"
            )
            for nid, outcome in run.done_rooms.items():
                report = RoomReport(
                    nid, status=outcome.status, state_groups=outcome.state_groups, rows_before=outcome.rows_before,
                    rows_after=outcome.rows_after, rewritten=outcome.groups_rewritten, earlier_attempt=True,
                )
                if outcome.detail:
                    report.detail.append(outcome.detail)
                self.resumed_rooms.append(report)
            if run.done_rooms:
                self.say(f"  {len(run.done_rooms)} room(s) already finished by the interrupted attempt: skipped")
            where, where_args = self.room_filter()
            if where is None:
                self.say("  no rooms selected")
            else:
                lo, hi, count = writer.group_bounds(run.snapshot_max, where.format(col="room_nid"), where_args)
                if not count:
                    self.say("  nothing to do: no state groups selected")
                else:
                    spark = self.start_spark()
                    self.compute_and_write(spark, lo, hi, count, where, where_args)
            if not a.dry_run:
                writer.finish_run(run)
        finally:
            if spark is not None:
                spark.stop()
            writer.close()
            self.timings["total"] = time.monotonic() - t0
        self.report(started)
        failed = [r for r in self.all_rooms() if r.status in FAILED_STATUSES]
        if failed:
            status = EXIT_ROOMS_FAILED
        return status

    def all_rooms(self) -> List[RoomReport]:
        return self.resumed_rooms + [self.rooms[n] for n in self.order]

    def room_filter(self) -> Tuple[Optional[str], List[Any]]:
        """A condition on ``{col}`` (a room_nid column) selecting the rooms to
        process: "" for every room, None when the selection is empty."""
        a, run = self.args, self.run
        clauses: List[str] = []
        args: List[Any] = []
        if a.rooms:
            spec = a.rooms.strip()
            if spec.startswith("largest:"):
                try:
                    n = int(spec.split(":", 1)[1])
                except ValueError:
                    raise SystemExit(f"--rooms {spec!r}: expected largest:N") from None
                nids = self.writer.largest_rooms(n, run.snapshot_max)
            else:
                ids = [r.strip() for r in spec.split(",") if r.strip()]
                found = self.writer.room_nids(ids)
                for room_id in ids:
                    if room_id not in found:
                        self.warn(f"room {room_id} is not in the database: skipped")
                nids = sorted(set(found.values()))
            if not nids:
                return None, []
            clauses.append("{col} IN (" + ", ".join(str(int(n)) for n in nids) + ")")
        if run.run_id is not None and run.resumed:
            clauses.append(
                "{col} NOT IN (SELECT room_nid FROM state_compaction_rooms WHERE run_id = " + str(int(run.run_id)) + ")"
            )
        return " AND ".join(clauses), args

    def start_spark(self) -> Any:
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\..*)?")
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.appName(APP_NAME)
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("WARN")
        return spark

    # -- Spark --------------------------------------------------------------

    def build_frame(self, spark: Any, lo: int, hi: int, count: int, where: str) -> Any:
        """The per-chunk result frame (not yet computed)."""
        from pyspark.sql import functions as F

        a, run = self.args, self.run
        source = JdbcSource.from_db_url(a.db)
        parallelism = spark.sparkContext.defaultParallelism
        read_parts = a.read_partitions or max(parallelism, min(256, -(-count // 100_000)))
        read_parts = max(1, min(read_parts, hi - lo + 1))
        shuffle_parts = a.shuffle_partitions or max(parallelism, min(512, -(-count // 50_000)))
        # Joins and exchanges of this job follow the data's size, not the
        # 200-partition default (each task costs scheduling time).
        spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_parts))
        snap = int(run.snapshot_max)
        cond = where.format(col="room_nid") if where else ""
        extra = f" AND {cond}" if cond else ""

        t = time.monotonic()
        starts, links = self.writer.chunk_layout(snap, a.chunk_groups, cond)
        self.timings["chunk_layout"] = time.monotonic() - t
        self.chunked_rooms = len(starts)
        boundary_ids = sorted({prev for _, _, prev in links})
        self.timings["boundary_groups"] = len(boundary_ids)

        groups = source.read(
            spark,
            f"(SELECT state_group, room_nid, prev_state_group, chain_length FROM state_groups"
            f" WHERE state_group <= {snap}{extra}) AS sg",
            "state_group LONG, room_nid LONG, prev_state_group LONG, chain_length LONG",
            (lo, hi, read_parts),
        )
        if cond:
            deltas_sql = (
                "(SELECT d.state_group, d.type_key_nid, d.event_nid FROM state_group_deltas d"
                " JOIN state_groups g ON g.state_group = d.state_group"
                f" WHERE d.state_group <= {snap} AND {where.format(col='g.room_nid')}) AS sgd"
            )
        else:
            deltas_sql = (
                "(SELECT state_group, type_key_nid, event_nid FROM state_group_deltas"
                f" WHERE state_group <= {snap}) AS sgd"
            )
        deltas = source.read(spark, deltas_sql, "state_group LONG, type_key_nid LONG, event_nid LONG", (lo, hi, read_parts))
        cols = ["room_nid", "sort_id", "kind", "state_group", "prev_state_group", "chain_length", "type_key_nid", "event_nid"]
        rows = groups.join(deltas, "state_group", "left").select(
            "room_nid", F.col("state_group").alias("sort_id"), F.lit(1).cast("long").alias("kind"), "state_group",
            "prev_state_group", "chain_length", "type_key_nid", "event_nid",
        )
        if boundary_ids:
            # (room, sort_id, boundary group): sort_id is the first group of the
            # chunk that needs the state (0 for a room's first chunk).
            placed = [
                (room, 0 if chunk == 0 else starts[room][chunk - 1], prev) for room, chunk, prev in links
            ]
            needs = spark.createDataFrame(placed, "room_nid long, sort_id long, boundary_group long")
            schema = "boundary_group LONG, type_key_nid LONG, event_nid LONG"
            states = None
            for start in range(0, len(boundary_ids), 2000):
                part = source.read(spark, f"({boundary_states_sql(boundary_ids[start:start + 2000])}) AS boundary", schema)
                states = part if states is None else states.unionByName(part)
            boundary_rows = needs.join(states, "boundary_group").select(
                "room_nid", "sort_id", F.lit(0).cast("long").alias("kind"), F.col("boundary_group").alias("state_group"),
                F.lit(None).cast("long").alias("prev_state_group"), F.lit(None).cast("long").alias("chain_length"),
                "type_key_nid", "event_nid",
            )
            rows = rows.select(*cols).unionByName(boundary_rows.select(*cols))
        fault_room = None
        if a.inject_fault_room:
            fault_room = self.writer.room_nids([a.inject_fault_room]).get(a.inject_fault_room)
        fn = make_room_function(
            {
                "strategy": a.strategy, "levels": self.levels, "max_hops": self.max_hops, "window": a.window,
                "emit": not a.dry_run, "fault_room": fault_room, "starts": starts,
            }
        )
        # Rows of a room in (sort_id, kind, id, key) order: the grouped map
        # keeps the order of its sorted input, and the iterator form hands the
        # room over in batches, so a worker never holds more than a chunk.
        return (
            rows.repartition(shuffle_parts, "room_nid")
            .sortWithinPartitions("room_nid", "sort_id", "kind", "state_group", "type_key_nid")
            .groupBy("room_nid")
            .applyInArrow(fn, OUTPUT_SCHEMA)
        )

    def compute_and_write(self, spark: Any, lo: int, hi: int, count: int, where: str, where_args: List[Any]) -> None:
        from pyspark import StorageLevel

        t = time.monotonic()
        cond = where.format(col="room_nid") if where else ""
        self.room_names = self.writer.room_ids_where(self.run.snapshot_max, cond)
        self.total_rooms = self.writer.count_rooms(self.run.snapshot_max, cond)
        result = self.build_frame(spark, lo, hi, count, where).persist(StorageLevel.MEMORY_AND_DISK)
        chunks = result.count()
        self.timings["read_and_plan"] = time.monotonic() - t
        self.say(
            f"  planned {self.total_rooms} room(s), {count:,} state groups in {chunks} chunk(s)"
            f" ({self.chunked_rooms} room(s) chunked, {self.timings['boundary_groups']} boundary state(s)),"
            f" {self.timings['read_and_plan']:.1f}s"
        )
        from roomstore.progress import progress_bar

        t = time.monotonic()
        bar = progress_bar(chunks, "compaction", "chunk", force=self.args.progress)
        for row in result.toLocalIterator(prefetchPartitions=True):
            self.handle(row)
            bar.update(1)
        bar.close()
        self.timings["write"] = time.monotonic() - t
        result.unpersist()

    # -- per chunk / per room -------------------------------------------------

    def handle(self, row: Any) -> None:
        """One chunk row from the executors: account, stage, and at the
        room's last chunk decide and write."""
        nid = row["room_nid"]
        room = self.rooms.get(nid)
        if room is None:
            room = self.rooms[nid] = RoomReport(nid)
            self.order.append(nid)
        if row["status"] == "error":
            room.error = row["detail"]
        elif not room.error:
            first, last = row["first_group"], row["last_group"]
            done = self.run.done_chunks.get((nid, first))
            already = done is not None and done[0] == last
            before, after, rewritten = (done[1], done[2], done[3]) if already else (
                row["rows_before"], row["rows_after"], row["rewritten"])
            room.chunks += 1
            room.state_groups += row["state_groups"]
            room.rows_before += before
            room.rows_after += after
            room.rewritten += rewritten
            room.chain_updates += row["chain_updates"]
            room.missing += row["missing"]
            room.mismatched += row["mismatched"]
            room.max_depth = max(room.max_depth, row["max_depth"])
            if row["detail"]:
                room.detail.append(row["detail"])
            has_changes = bool(row["rewritten"] or row["chain_updates"])
            room.chunk_list.append((first, last, before, after, rewritten, has_changes, already, row["chain_updates"]))
            if has_changes and not already and not self.args.dry_run and not room.mismatched:
                chunk = ChunkResult(
                    first_group=first, last_group=last, state_groups=row["state_groups"], rows_before=before,
                    rows_after=after, rewritten=rewritten, chain_updates=row["chain_updates"],
                    max_depth=row["max_depth"], boundary=row["boundary"], missing={}, mismatched=[],
                    groups=np.frombuffer(row["groups_blob"], dtype="<i8").reshape(-1, 7),
                    refs=np.frombuffer(row["refs_blob"], dtype="<i8"),
                    deltas=np.frombuffer(row["deltas_blob"], dtype="<i8").reshape(-1, 3),
                )
                self.writer.stage_chunk(self.run, chunk.to_staged(nid))
        if row["is_last"]:
            self.finish_room(room)

    def finish_room(self, room: RoomReport) -> None:
        from roomstore.compaction.writer import RoomOutcome

        a, writer, run = self.args, self.writer, self.run
        room.room_id = self.room_names.get(room.room_nid) or f"<room_nid {room.room_nid}>"
        if room.error:
            room.status = "error"
            log.error("room %s: %s; left untouched", room.room_id, room.error)
        elif room.mismatched:
            room.status = "mismatch"
            log.error(
                "room %s: %d state group(s) would change state under the new representation; left untouched (%s)",
                room.room_id, room.mismatched, "; ".join(room.detail),
            )
        elif not room.rewritten and not room.chain_updates:
            room.status = "unchanged"
        elif room.saving < a.min_saving:
            room.status = "below_min_saving"
        else:
            room.status = STATUS_WOULD_WRITE if a.dry_run else STATUS_WRITTEN
        if room.missing:
            self.warn(
                f"room {room.room_id}: {room.missing} state group(s) whose predecessor chain reaches a missing"
                f" (purged) group were skipped"
            )
        if not a.dry_run:
            if room.status == STATUS_WRITTEN:
                self.swap_room(room)
            else:
                writer.record_room(run, self._outcome(room, RoomOutcome))
        self.done += 1
        self.rows_so_far[0] += room.rows_before
        self.rows_so_far[1] += room.rows_after
        # Every room that changed or failed gets a line; quiet rooms only now
        # and then, so a server with 100,000 small rooms gets a readable log.
        noteworthy = room.status not in ("unchanged", "below_min_saving")
        if noteworthy or self.done % 500 == 0 or self.done == self.total_rooms:
            self.say(
                f"  [{self.done}/{self.total_rooms}] {room.room_id}: {room.status}, {room.rows_before:,} -> "
                f"{room.rows_after:,} rows ({room.state_groups:,} groups, {room.chunks} chunk(s))"
                f" | so far {self.rows_so_far[0]:,} -> {self.rows_so_far[1]:,}"
            )

    def _outcome(self, room: RoomReport, cls: Any) -> Any:
        return cls(
            room.room_nid, room.status, room.state_groups, room.rows_before, room.rows_after, room.rewritten,
            "; ".join(d for d in room.detail if d) or room.error,
        )

    def swap_room(self, room: RoomReport) -> None:
        from roomstore.compaction.writer import RoomOutcome

        writer, run = self.writer, self.run
        todo = [c for c in room.chunk_list if c[5] and not c[6]]
        if not todo:
            writer.record_room(run, self._outcome(room, RoomOutcome))
            return
        for index, (first, last, before, after, rewritten, _, _, chain_updates) in enumerate(todo):
            last_one = index == len(todo) - 1
            result = writer.swap_chunk(
                run, room.room_nid, first, (last, before, after, rewritten),
                self._outcome(room, RoomOutcome) if last_one else None,
                chain_changed=chain_updates > 0,
            )
            if result.status != "swapped":
                room.status = "changed_underneath"
                room.detail.append(result.detail)
                self.warn(
                    f"room {room.room_id}: {result.detail}; skipping the rest of the room"
                    f" ({index} of {len(todo)} chunk(s) were already swapped in and stay valid)"
                )
                writer.record_room(run, self._outcome(room, RoomOutcome))
                break
        if self.args.swap_delay:
            time.sleep(self.args.swap_delay)

    # -- reporting ------------------------------------------------------------

    def totals(self) -> Dict[str, Any]:
        rooms = self.all_rooms()
        by_status: Dict[str, int] = {}
        for r in rooms:
            by_status[r.status] = by_status.get(r.status, 0) + 1
        written = [r for r in rooms if r.status in (STATUS_WRITTEN, STATUS_WOULD_WRITE)]
        return {
            "rooms": len(rooms),
            "rooms_by_status": by_status,
            "state_groups": sum(r.state_groups for r in rooms),
            "rows_before": sum(r.rows_before for r in rooms),
            "rows_after": sum(r.rows_after for r in rooms),
            "rows_written_before": sum(r.rows_before for r in written),
            "rows_written_after": sum(r.rows_after for r in written),
            "rows_saved": sum(r.saving for r in written),
            "groups_rewritten": sum(r.rewritten for r in written),
            "mismatched_groups": sum(r.mismatched for r in rooms),
            "missing_groups": sum(r.missing for r in rooms),
            "max_hops": max((r.max_depth for r in rooms), default=0),
        }

    def report(self, started: float) -> None:
        a = self.args
        totals = self.totals()
        rooms = self.all_rooms()
        self.say("")
        self.say(f"{'room':<40} {'status':<18} {'groups':>9} {'rows before':>12} {'rows after':>11} {'saved':>8}")
        shown = sorted(rooms, key=lambda r: (-r.saving, r.room_nid))[:20]
        for r in shown:
            name = r.room_id or f"<room_nid {r.room_nid}>"
            if len(name) > 40:
                name = name[:37] + "..."
            pct = f"{r.saving / r.rows_before:.0%}" if r.rows_before else "-"
            self.say(f"{name:<40} {r.status:<18} {r.state_groups:>9,} {r.rows_before:>12,} {r.rows_after:>11,} {pct:>8}")
        if len(rooms) > len(shown):
            self.say(f"... and {len(rooms) - len(shown)} more room(s) (see --summary-json)")
        saved = totals["rows_saved"]
        verb = "would save" if a.dry_run else "saved"
        self.say(
            f"total: {totals['rooms']} room(s) {totals['rooms_by_status']}; {totals['rows_before']:,} -> "
            f"{totals['rows_after']:,} rows in the rooms examined; {verb} {saved:,} rows"
            f" in {self.timings.get('total', 0):.1f}s"
        )
        if not a.dry_run and saved:
            self.say("note: tables do not shrink on disk by themselves; see docs/compaction.md (VACUUM)")
        if self.warnings:
            self.say(f"{len(self.warnings)} warning(s); see above or the summary JSON")
        summary = {
            "run_id": self.run.run_id if self.run else None,
            "resumed": bool(self.run and self.run.resumed),
            "dry_run": a.dry_run,
            "snapshot_max": self.run.snapshot_max if self.run else None,
            "database": self.writer.db.engine.describe() if self.writer else None,
            "options": self.options(),
            "started_at": started,
            "duration_s": round(self.timings.get("total", 0.0), 3),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items() if k != "boundary_groups"},
            "chunked_rooms": self.chunked_rooms,
            "boundary_groups": self.timings.get("boundary_groups", 0),
            "totals": totals,
            "rooms": [r.as_json() for r in rooms],
            "warnings": self.warnings,
        }
        if a.summary_json:
            _write_atomic(a.summary_json, json.dumps(summary, indent=2, sort_keys=True) + "\n")
        if a.metrics_file:
            write_metrics(a.metrics_file, summary)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_metrics(path: str, summary: Mapping[str, Any]) -> None:
    """Prometheus text format (node-exporter textfile collector / pushgateway).

    Gauges describing the last run; written atomically (temporary file, then
    rename), so a scraper never reads half a file.
    """
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    registry = CollectorRegistry()
    totals = summary["totals"]
    prefix = "roomstore_state_compaction_"

    def gauge(name: str, doc: str, value: float, labels: Optional[Dict[str, str]] = None) -> None:
        if labels:
            g = Gauge(prefix + name, doc, list(labels), registry=registry)
            g.labels(**labels).set(value)
        else:
            Gauge(prefix + name, doc, registry=registry).set(value)

    failed = sum(totals["rooms_by_status"].get(s, 0) for s in FAILED_STATUSES)
    gauge("last_run_timestamp_seconds", "When the last compaction run started (Unix time)", summary["started_at"])
    gauge("last_run_duration_seconds", "Wall time of the last compaction run", summary["duration_s"])
    gauge("last_run_success", "1 if the last run left no room unverified or failed", 0 if failed else 1)
    gauge("last_run_dry_run", "1 if the last run was a dry run", 1 if summary["dry_run"] else 0)
    gauge("snapshot_max_state_group", "Highest state group the last run considered", summary["snapshot_max"] or 0)
    g = Gauge(prefix + "rooms", "Rooms examined by the last run, by outcome", ["status"], registry=registry)
    for status in ("written", "would_write", "unchanged", "below_min_saving", "mismatch", "error", "changed_underneath"):
        g.labels(status=status).set(totals["rooms_by_status"].get(status, 0))
    gauge("state_groups", "State groups examined by the last run", totals["state_groups"])
    gauge("rows_before", "Delta rows of the examined rooms before the last run", totals["rows_before"])
    gauge("rows_after", "Delta rows of the examined rooms after the last run (as planned)", totals["rows_after"])
    gauge("rows_saved", "Delta rows removed (or, dry run: removable) by the last run", totals["rows_saved"])
    gauge("groups_rewritten", "State groups given a new representation by the last run", totals["groups_rewritten"])
    gauge("mismatched_groups", "State groups whose verification failed (their rooms were not written)",
          totals["mismatched_groups"])
    gauge("missing_groups", "State groups skipped because their chain reaches a missing group", totals["missing_groups"])
    gauge("max_hops", "Longest predecessor chain after the last run", totals["max_hops"])
    write_to_textfile(path, registry)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under spark-submit: parse the job options and run."""
    args = job_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="roomstore-compact %(levelname)s: %(message)s", force=True
    )
    # py4j logs every callback at INFO.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        return Driver(args).execute()
    except SystemExit:
        raise
    except Exception as exc:
        log.error("compaction failed: %s", exc)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    # spark-submit runs this file as a script: its directory (roomstore/compaction)
    # is sys.path[0], where writer.py & co. would shadow top-level names, and the
    # executors must find the functions by their package name (from --py-files).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from roomstore.compaction import spark_job as _job

    sys.exit(_job.main())
