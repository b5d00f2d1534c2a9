"""Child process of test_crash: persists batches of events until killed.

usage: python -m tests.store.crash_writer DATABASE_URL RUN_TAG SEED [ROOMS]

Opens a ``RoomStore`` on the database, starts ROOMS (default 4) new rooms
named after RUN_TAG, then persists batches of about 50 events spread over
them (messages, topic and name changes, joins, redactions) for ever. For every
batch it prints, flushed, one line before calling ``persist_events`` and one
after it returned (so after the commit):

    INTENT <JSON list of the batch's event IDs>
    DONE <the same list>

and ``READY`` once the rooms exist. The parent kills it with SIGKILL at some
moment and checks that what is in the database is consistent with these lines.
"""

from __future__ import annotations

import json
import random
import sys

from twisted.internet import defer, task

from roomstore.store import RoomStore
from tests.store.builder import RoomBuilder

BATCH = 50


def say(kind: str, ids: list[str] | None = None) -> None:
    sys.stdout.write(kind if ids is None else f"{kind} {json.dumps(ids)}")
    sys.stdout.write("\n")
    sys.stdout.flush()


async def persist(store: RoomStore, batch) -> None:
    ids = [built.event_id for _, built in batch]
    say("INTENT", ids)
    # Shuffled: the store orders a batch by its prev events itself.
    random.shuffle(batch)
    await store.persist_events([room.to_persist(built) for room, built in batch])
    say("DONE", ids)


async def main(reactor, url: str, tag: str, seed: int, room_count: int) -> None:
    rng = random.Random(seed)
    store = await RoomStore.open(url)
    rooms = [RoomBuilder(room_id=f"!crash{tag}r{i}:example.org") for i in range(room_count)]
    users = [f"@user{i}:example.org" for i in range(20)]
    first = []
    for room in rooms:
        first += [(room, room.create()), (room, room.join(room.creator)), (room, room.join_rules())]
    await persist(store, first)
    say("READY")
    messages: dict[str, list[str]] = {room.room_id: [] for room in rooms}
    n = 0
    while True:
        batch = []
        for _ in range(BATCH + rng.randint(-5, 5)):
            room = rng.choice(rooms)
            roll = rng.random()
            n += 1
            if roll < 0.70:
                built = room.message(room.creator, f"message {n}")
                messages[room.room_id].append(built.event_id)
            elif roll < 0.80:
                built = room.state("m.room.topic", "", {"topic": f"topic {n}"})
            elif roll < 0.85:
                built = room.state("m.room.name", "", {"name": f"name {n}"})
            elif roll < 0.95:
                built = room.join(rng.choice(users))
            elif messages[room.room_id]:
                built = room.redact(room.creator, rng.choice(messages[room.room_id]))
            else:
                built = room.message(room.creator, f"message {n}")
            batch.append((room, built))
        await persist(store, batch)


if __name__ == "__main__":
    url, tag, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    room_count = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, url, tag, seed, room_count)))
