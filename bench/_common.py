"""Helpers shared by the benchmarks: databases to run on, timing, tables."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence


def bench_databases() -> list[tuple[str, Callable[[], str]]]:
    """(engine name, factory of fresh database URLs) for each engine available.

    PostgreSQL over TCP on loopback, or with ``ROOMSTORE_BENCH_POSTGRES_VIA=socket``
    over the server's Unix socket (``bench/with-postgres`` exports its
    directory as ``ROOMSTORE_BENCH_POSTGRES_SOCKET_DIR``), as a homeserver
    beside its database would connect: no TCP stack, none of its softirq work
    on the cores the homeserver's reactor runs on."""
    result: list[tuple[str, Callable[[], str]]] = []

    def sqlite_url() -> str:
        return f"sqlite:///{tempfile.mkdtemp(prefix='roomstore-bench-')}/bench.db"

    result.append(("sqlite", sqlite_url))
    admin = os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    via = os.environ.get("ROOMSTORE_BENCH_POSTGRES_VIA", "tcp")
    socket_dir = os.environ.get("ROOMSTORE_BENCH_POSTGRES_SOCKET_DIR", "")
    if via not in ("tcp", "socket") or (via == "socket" and not socket_dir):
        raise SystemExit("ROOMSTORE_BENCH_POSTGRES_VIA is tcp or socket (socket needs bench/with-postgres)")
    if admin:
        counter = [0]

        def pg_url() -> str:
            counter[0] += 1
            name = f"rs_bench_{os.getpid()}_{counter[0]}"
            url = new_postgres_database(admin, name)
            if via == "socket":
                parsed = urllib.parse.urlsplit(admin)
                query = urllib.parse.urlencode({"host": socket_dir, "port": parsed.port})
                return urllib.parse.urlunsplit((parsed.scheme, f"{parsed.username}@", "/" + name, query, ""))
            return url

        result.append(("postgres", pg_url))
    else:
        print("(no ROOMSTORE_BENCH_POSTGRES: PostgreSQL columns left out; use bench/with-postgres)")
    return result


def median_of(runs: int, fn: Callable[[], float]) -> tuple[float, list[float]]:
    samples = [fn() for _ in range(runs)]
    return statistics.median(samples), samples


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(c.rjust(w) if index else c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def new_postgres_database(admin: str, name: str) -> str:
    """Create the database ``name`` on the server of the admin URL ``admin``;
    its URL (over TCP, as ``admin``)."""
    import psycopg2

    conn = psycopg2.connect(admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    conn.close()
    parsed = urllib.parse.urlsplit(admin)
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, "/" + name, "", ""))
