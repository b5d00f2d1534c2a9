"""Child process of test_writer_lock: a writer that keeps its store open.

usage: python -m tests.store.holding_writer DATABASE_URL FILE.jsonl

Opens a ``RoomStore`` (instance ``master``), imports the first half of FILE,
prints ``READY <summary JSON>`` and waits for a line on stdin; then imports
the second half with the same store, prints ``DONE <summary JSON>`` and exits.
"""

from __future__ import annotations

import json
import sys

from twisted.internet import defer, task, threads

from roomstore.cli.import_loop import import_file
from roomstore.store import RoomStore


async def main(reactor, url: str, path: str) -> None:
    with open(path, "rb") as handle:
        lines = [line for line in handle if line.strip()]
    half = len(lines) // 2
    first, second = path + ".first", path + ".second"
    with open(first, "wb") as out:
        out.writelines(lines[:half])
    with open(second, "wb") as out:
        out.writelines(lines[half:])
    store = await RoomStore.open(url, reactor=reactor)
    try:
        summary = await import_file(store, first)
        sys.stdout.write(f"READY {json.dumps(summary)}\n")
        sys.stdout.flush()
        await threads.deferToThread(sys.stdin.readline)
        summary = await import_file(store, second)
        sys.stdout.write(f"DONE {json.dumps(summary)}\n")
        sys.stdout.flush()
    finally:
        await store.close()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1], sys.argv[2])))
