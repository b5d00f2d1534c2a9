"""A replication server process for the interop tests: what ``roomstore
serve`` runs (``ReplicationServerService``: a writer store serving its
streams on loopback TCP), plus a writer driven from stdin so rows can be
written while a client is connected.

usage: python -m tests.replication.interop_server DB_URL

Prints ``{"port": N}`` once listening. Then, per stdin line:
``events N`` persists N events (room create, joins, messages) in batches,
``invalidate N`` writes one invalidation of N keys; each answers
``{"done": ..., "positions": {...}}``. EOF stops the server.
"""

from __future__ import annotations

import json
import sys

from twisted.internet import defer, task
from twisted.internet.stdio import StandardIO
from twisted.protocols.basic import LineReceiver


class Commands(LineReceiver):
    delimiter = b"\n"

    def __init__(self, service, builder, finished: defer.Deferred) -> None:
        self.service = service
        self.builder = builder
        self.finished = finished
        self.queue = defer.DeferredLock()
        self.count = 0

    def lineReceived(self, line: bytes) -> None:
        self.queue.run(lambda: defer.ensureDeferred(self.run(line.decode().split())))

    async def run(self, words: list[str]) -> None:
        store = self.service.store
        what, n = words[0], int(words[1])
        if what == "events":
            room = self.builder(f"!interop{self.count}:example.org")
            self.count += 1
            events = [room.create(), room.join(room.creator)]
            events += [room.join(f"@u{i}:example.org") for i in range(3)]
            while len(events) < n:
                events.append(room.message(room.creator, f"message {len(events)}"))
            for start in range(0, n, 50):
                await store.persist_events([room.to_persist(e) for e in events[start : start + 50]])
        elif what == "invalidate":
            await store.invalidate_cache("get_event", [f"$key{i:06d}:example.org" for i in range(n)])
        positions = {name: g.get_current_token() for name, g in store.generators.items()}
        self.sendLine(json.dumps({"done": what, "positions": positions}).encode())

    def connectionLost(self, reason) -> None:
        self.finished.callback(None)


async def main(reactor, url: str) -> None:
    from roomstore.replication.process_services import ReplicationServerService
    from tests.store.builder import UncheckedRoomBuilder as RoomBuilder  # rows, not the auth rules

    service = ReplicationServerService(url, port=0, server_name="hs.example", reactor=reactor)
    service.startService()
    await service.when_ready()
    finished: defer.Deferred = defer.Deferred()
    StandardIO(Commands(service, RoomBuilder, finished), reactor=reactor)
    print(json.dumps({"port": service.port.getHost().port}), flush=True)
    await finished
    await service.stopService()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1])))
