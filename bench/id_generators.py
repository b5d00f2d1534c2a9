"""Stream IDs reserved and completed per second, on each engine.

usage: bench/with-postgres .venv/bin/python bench/id_generators.py [--ids N] [--runs R]

For batch sizes 1 (get_next) and 100 (get_next_mult), reserves and completes
N IDs with nothing written in between, and prints the median rate of R runs.
SQLite uses the in-process counter; PostgreSQL a sequence (one nextval round
trip per reservation), so batching matters there.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

from twisted.internet import defer, task

from bench._common import bench_databases, print_table
from roomstore.storage import open_database
from roomstore.streams import StreamIdGenerator


async def rate(url: str, ids: int, batch: int) -> float:
    db = await open_database(url)
    gen = await StreamIdGenerator.create(db, "events", "master")
    start = time.perf_counter()
    done = 0
    while done < ids:
        if batch == 1:
            async with gen.get_next():
                pass
        else:
            async with gen.get_next_mult(batch):
                pass
        done += batch
    elapsed = time.perf_counter() - start
    await gen.close()
    await db.close()
    return done / elapsed


async def main(reactor, args) -> None:
    rows = []
    for engine, new_url in bench_databases():
        for batch in (1, 100):
            count = args.ids if batch > 1 or engine == "sqlite" else max(args.ids // 10, 100)
            samples = [await rate(new_url(), count, batch) for _ in range(args.runs)]
            samples.sort()
            rows.append([engine, batch, count, samples[len(samples) // 2], samples[0], samples[-1]])
    print_table(["engine", "batch", "ids/run", "median ids/s", "min", "max"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
