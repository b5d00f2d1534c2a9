"""A writer process for the two-process stream ID test (not a test module).

usage: two_writer_worker.py DB_URL MY_NAME OTHER_NAME COUNT

Reserves COUNT IDs in batches with get_next_mult, writes one fact row per ID
inside the reservation, persists its position, exchanges positions with the other writer through
stream_positions rows (standing in for replication), and prints its positions
as JSON.
"""

import json
import sys

from twisted.internet import defer, task

from roomstore.storage import Database
from roomstore.streams import BackingTable, StreamIdGenerator


async def main(reactor, url, me, other, count):
    db = Database.from_url(url, reactor)
    gen = await StreamIdGenerator.create(
        db,
        "events",
        me,
        writers=sorted([me, other]),
        backing_tables=[BackingTable("facts", "stream_id", "instance_name")],
    )
    done = 0
    while done < count:
        n = min(97, count - done)  # an odd batch size interleaves the writers' IDs
        async with gen.get_next_mult(n) as ids:
            await db.run_interaction(
                "write_facts", lambda t: t.insert_many("facts", ("stream_id", "instance_name"), [(i, me) for i in ids])
            )
        done += n
    await gen.flush()
    # Exchange positions as replication's POSITION commands would, twice: an
    # idle writer moves up when it hears of the other's progress, and the
    # second round tells the other side about that move.
    for round_no in (1, 2):
        label = f"round{round_no}"
        await db.run_interaction(
            "announce",
            lambda t: t.execute(
                "INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES (?, ?, ?)",
                (label, me, gen.get_current_token_for_writer(me)),
            ),
        )
        while True:
            row = await db.run_interaction(
                "poll",
                lambda t: t.execute(
                    "SELECT stream_id FROM stream_positions WHERE stream_name = ? AND instance_name = ?",
                    (label, other),
                ).fetchone(),
            )
            if row is not None:
                break
            await task.deferLater(reactor, 0.05, lambda: None)
        gen.advance(other, row[0])
    print(json.dumps({"positions": gen.get_positions(), "unfinished": gen.get_unfinished()}))
    await db.close()


if __name__ == "__main__":
    url, me, other, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, url, me, other, count)))
