"""Command-line options of the compaction job and of ``bin/roomstore-compact``.

Shared by the launcher (:mod:`~roomstore.compaction.job.submit`, which adds
the spark-submit options) and the driver (:mod:`~roomstore.compaction.job.driver`,
which parses the job options under spark-submit). Exit codes live here too.
"""

from __future__ import annotations

import argparse
import socket

from roomstore.compaction import DEFAULT_LEVELS, DEFAULT_WINDOW
from roomstore.compaction.write_back import DEFAULT_HEARTBEAT_SECONDS, DEFAULT_STALE_LOCK_SECONDS

APP_NAME = "roomstore-state-compaction"
DEFAULT_CHUNK_GROUPS = 10_000
#: Exit codes: 2 = finished, but rooms failed verification or raised errors
#: (they were left untouched); 75 (EX_TEMPFAIL) = another job holds the lock.
EXIT_ROOMS_FAILED = 2
EXIT_LOCKED = 75


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"levels must be comma-separated integers, not {text!r}") from None
    if not levels or any(size < 1 for size in levels):
        raise argparse.ArgumentTypeError("levels must be positive chain lengths, e.g. 100,50,25")
    return levels


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job options")
    target = job.add_mutually_exclusive_group(required=True)
    target.add_argument("--db", help="roomstore database URL: postgresql://user@host:port/db or sqlite:///path")
    target.add_argument(
        "--synapse",
        metavar="URL",
        help="instead of --db: a Synapse PostgreSQL database (postgresql://user@host:port/synapse), compacted in place",
    )
    job.add_argument(
        "--rooms",
        help="comma-separated room IDs, or largest:N for the N rooms with the most state groups (default: all)",
    )
    job.add_argument("--levels", type=parse_levels, default=DEFAULT_LEVELS, help="level sizes (default 100,50,25)")
    job.add_argument(
        "--max-hops",
        type=int,
        default=None,
        help="longest predecessor chain allowed after compaction (default: sum(level - 1), 172 for the default)",
    )
    job.add_argument(
        "--min-saving",
        type=int,
        default=1,
        help="leave a room alone unless it saves at least this many rows (default 1)",
    )
    job.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")
    job.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    job.add_argument(
        "--chunk-groups",
        type=int,
        default=DEFAULT_CHUNK_GROUPS,
        help=f"state groups per chunk: bounds a worker's memory (default {DEFAULT_CHUNK_GROUPS}; 0: whole rooms)",
    )
    job.add_argument("--summary-json", metavar="PATH", help="write the run summary as JSON here")
    job.add_argument("--metrics-file", metavar="PATH", help="write Prometheus text-format figures here (atomically)")
    job.add_argument(
        "--strategy", choices=("smart", "levels"), default="smart", help="compaction strategy (default smart)"
    )
    job.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="recent groups considered as bases (smart)")
    job.add_argument("--read-partitions", type=int, default=0, help="JDBC read partitions (default: automatic)")
    job.add_argument(
        "--shuffle-partitions", type=int, default=0, help="partitions rooms are spread over (default: automatic)"
    )
    job.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_STALE_LOCK_SECONDS,
        help="seconds after which another job's lock heartbeat counts as stale (default 600)",
    )
    job.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT_SECONDS,
        help="seconds between lock heartbeats (default 30)",
    )
    # Test-only knobs, deliberately undocumented in --help.
    job.add_argument("--inject-fault-room", help=argparse.SUPPRESS)
    job.add_argument("--swap-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    job.add_argument("--swap-hold", type=float, default=0.0, help=argparse.SUPPRESS)
    job.add_argument("--swap-hold-release", help=argparse.SUPPRESS)


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
        "--driver-java-options",
        action="append",
        default=[],
        metavar="OPTS",
        help="extra JVM options for the driver (kept together with the wrapper's quiet log4j setting); e.g."
        " -XX:TieredStopAtLevel=1 starts short local runs faster",
    )
    spark.add_argument(
        "--jdbc-jar", action="append", default=[], metavar="JAR", help="JDBC driver jar (default: by URL)"
    )
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


#: How long the launcher and the driver wait for a standalone master's port.
MASTER_PROBE_SECONDS = 5.0


def unreachable_master(master: str, timeout: float = MASTER_PROBE_SECONDS) -> str | None:
    """None when ``master`` is not a standalone ``spark://`` URL or one of its
    masters accepts a TCP connection; else a one-line reason.

    Spark itself retries an unreachable standalone master for about a minute
    and prints pages of traces; this probe fails first, in at most
    ``timeout`` seconds per listed master.
    """
    if not master.startswith("spark://"):
        return None
    reasons = []
    for hostport in master[len("spark://") :].split(","):
        host, _, port = hostport.strip().rpartition(":")
        host = host.strip("[]")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return None
        except ValueError:
            return f"--master {master}: write spark://HOST:PORT[,HOST:PORT...]"
        except OSError as exc:
            reasons.append(f"{hostport}: {exc.strerror or exc}")
    return (
        f"cannot reach the Spark master {master} ({'; '.join(reasons)}): start it, or check --master"
        " (local[*] runs Spark in this process)"
    )
