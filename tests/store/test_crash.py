"""Crash safety: a writer killed with SIGKILL mid-way leaves a consistent store.

A child process (``tests/store/crash_writer.py``) persists batches of ~50
events over several rooms in a loop, printing each batch's event IDs before
(``INTENT``) and after (``DONE``) ``persist_events``. The test kills it at a
random moment once it has committed a few batches, aiming inside a batch,
then opens a new store on the same PostgreSQL database and checks:

* batches are all-or-nothing: every DONE batch is wholly present, every other
  batch wholly present or wholly absent, and nothing else is stored;
* every event has its exact bytes in ``event_json`` (they hash to its ID),
  exactly its prev edges in ``event_edges``, and state groups that resolve
  (the state after a state event holds the event itself); every state group's
  predecessor exists; current state and extremities point at stored events,
  and a room's current state is the state at its single extremity;
* stream recovery: the current token is at least max(stream_ordering), and
  the next batch gets fresh, larger stream orderings;
* the store takes new batches, in old rooms and new ones.

Three kills per test, at different moments, on one database. PostgreSQL
only: killing a client mid-transaction is a server-side rollback there;
SQLite's equivalent (a torn process on a WAL file) is its own library's
guarantee.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.room_versions import get_room_version
from roomstore.state.groups import StateGroupStore
from roomstore.store import RoomStore
from tests.db import DatabaseTestMixin
from tests.store.builder import RoomBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLS = 3


def run_and_kill(
    url: str, tag: str, seed: int, rng: random.Random, min_done: int
) -> tuple[list[list[str]], set[tuple], str]:
    """Run a writer, SIGKILL it once it committed ``min_done`` batches, at a
    random point of a later batch; returns (intended batches, done batches, what happened)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.store.crash_writer", url, tag, str(seed)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    intents: list[list[str]] = []
    done: set[tuple] = set()
    durations: list[float] = []
    started = 0.0
    deadline = time.monotonic() + 120
    try:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"writer exited early ({proc.wait()}): {proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("writer made too little progress")
            kind, _, rest = line.decode().rstrip("\n").partition(" ")
            if kind == "INTENT":
                intents.append(json.loads(rest))
                started = time.monotonic()
                if len(done) >= min_done + 1:
                    # Inside this batch, somewhere between reserving IDs and
                    # the commit (a batch takes about the median time seen).
                    pause = rng.uniform(0, 1.2 * sorted(durations)[len(durations) // 2])
                    time.sleep(pause)
                    proc.send_signal(signal.SIGKILL)
                    break
            elif kind == "DONE":
                done.add(tuple(json.loads(rest)))
                durations.append(time.monotonic() - started)
        # Complete lines written before the kill still count (a torn last
        # line, without its newline, does not).
        for line in proc.stdout.read().split(b"\n")[:-1]:
            kind, _, rest = line.decode().partition(" ")
            if kind == "DONE":
                done.add(tuple(json.loads(rest)))
            elif kind == "INTENT":
                intents.append(json.loads(rest))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    median = sorted(durations)[len(durations) // 2]
    return (
        intents,
        done,
        (
            f"killed {pause * 1000:.0f} ms into batch {len(intents)} (median batch {median * 1000:.0f} ms)"
            f" after {len(done)} committed"
        ),
    )


class CrashTests(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"
    timeout = 600

    async def test_sigkill_mid_batch_leaves_a_consistent_store(self):
        url = self.new_database_url()
        seed = int(os.environ.get("ROOMSTORE_CRASH_SEED", random.randrange(2**31)))
        rng = random.Random(seed)
        all_intents: list[list[str]] = []
        all_done: set[tuple] = set()
        extra: set[str] = set()  # events this test itself persisted after crashes
        outcomes = []
        for run in range(KILLS):
            min_done = rng.randint(1, 6) + 2 * run
            intents, done, what = await threads.deferToThread(
                run_and_kill, url, f"{run}x", rng.randrange(2**31), rng, min_done
            )
            all_intents += intents
            all_done |= done
            outcomes.append(what)
            added, in_flight = await self.check_store(url, all_intents, all_done, extra, run)
            extra |= added
            outcomes.append(f"{outcomes.pop()}, in-flight batch {'stored' if in_flight else 'rolled back'}")
        # Kills at different moments (and say where, for a failure report).
        print(f"crash seed {seed}: " + "; ".join(outcomes))
        self.assertEqual(len(set(outcomes)), KILLS)

    async def check_store(self, url: str, intents, done, extra: set[str], run: int) -> tuple[set[str], bool]:
        store = await RoomStore.open(url)
        try:
            return await self._check(store, intents, done, extra, run)
        finally:
            await store.close()

    async def _check(self, store: RoomStore, intents, done, extra: set[str], run: int) -> tuple[set[str], bool]:
        """Check the store after a kill; returns (events added here, whether
        the batch in flight at the kill is stored)."""
        stored = await store.db.run_interaction(
            "ids",
            lambda t: {
                r[0]: r[1]
                for r in t.execute(
                    "SELECT i.event_id, e.event_nid FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
                ).fetchall()
            },
        )
        # All or nothing, batch by batch.
        for batch in intents:
            present = [e in stored for e in batch]
            if tuple(batch) in done:
                self.assertTrue(all(present), f"a committed batch lost {present.count(False)} events")
            else:
                self.assertIn(sum(present), (0, len(batch)), "a batch is partly stored")
        intended = {e for b in intents for e in b}
        self.assertEqual(set(stored) - intended - extra, set(), "events nobody wrote")
        committed_unreported = [b for b in intents if tuple(b) not in done and b[0] in stored]
        self.assertLessEqual(len(committed_unreported), 1)  # at most the batch being killed

        # Every event: exact bytes, edges, state groups that resolve.
        def rows_txn(txn):
            return txn.execute(
                "SELECT i.event_id, e.event_nid, j.json, j.room_version, e.outlier, e.state_group_before,"
                " e.state_group, e.type, e.type_key_nid FROM events AS e"
                " JOIN event_ids AS i ON i.event_nid = e.event_nid"
                " LEFT JOIN event_json AS j ON j.event_nid = e.event_nid"
            ).fetchall()

        rows = await store.db.run_interaction("rows", rows_txn)
        edges = await store.db.run_interaction(
            "edges",
            lambda t: t.execute(
                "SELECT e.event_nid, i.event_id FROM event_edges AS e"
                " JOIN event_ids AS i ON i.event_nid = e.prev_event_nid"
            ).fetchall(),
        )
        edges_of: dict[int, set[str]] = {}
        for nid, prev_id in edges:
            edges_of.setdefault(nid, set()).add(prev_id)
        groups = StateGroupStore()

        def state_txn(txn, group):
            return groups.get_state(txn, group)

        for event_id, nid, raw, version, outlier, before, after, event_type, type_key in rows:
            self.assertIsNotNone(raw, f"{event_id} has no event_json")
            pdu = parse_pdu(bytes(raw), get_room_version(version))
            self.assertEqual(pdu.event_id, event_id)
            self.assertEqual(edges_of.get(nid, set()), set(pdu.prev_event_ids), f"edges of {event_id}")
            self.assertFalse(outlier)
            self.assertIsNotNone(after)
            if event_type != "m.room.create":
                self.assertIsNotNone(before)
                await store.db.run_interaction("state", state_txn, before)
            state_after = await store.db.run_interaction("state", state_txn, after)
            if type_key is not None:
                self.assertEqual(state_after.get(type_key), nid, f"state after {event_id}")
        dangling = await store.db.run_interaction(
            "dangling",
            lambda t: t.execute(
                "SELECT COUNT(*) FROM state_groups AS g WHERE g.prev_state_group IS NOT NULL AND NOT EXISTS"
                " (SELECT 1 FROM state_groups AS p WHERE p.state_group = g.prev_state_group)"
            ).fetchone()[0],
        )
        self.assertEqual(dangling, 0)
        for table in ("forward_extremities", "current_state"):
            orphans = await store.db.run_interaction(
                "orphans",
                lambda t: t.execute(
                    f"SELECT COUNT(*) FROM {table} AS x WHERE NOT EXISTS"
                    " (SELECT 1 FROM events AS e WHERE e.event_nid = x.event_nid)"
                ).fetchone()[0],
            )
            self.assertEqual(orphans, 0, table)
        room_ids = await store.db.run_interaction(
            "rooms", lambda t: [r[0] for r in t.execute("SELECT room_id FROM rooms ORDER BY room_id").fetchall()]
        )
        for room_id in room_ids:
            leaves = await store.get_forward_extremities(room_id)
            self.assertEqual(len(leaves), 1, room_id)  # the writer builds linear rooms
            self.assertEqual(await store.get_current_state_ids(room_id), await store.get_state_ids(leaves[0]))

        # Stream recovery: the token covers everything stored; new IDs are fresh.
        newest = await store.db.run_interaction(
            "max", lambda t: t.select_one_value("SELECT MAX(stream_ordering) FROM events")
        )
        self.assertGreaterEqual(store.events_stream.get_current_token(), newest)
        # New batches go in: one in an old room, one in a new room.
        old_room = room_ids[run % len(room_ids)]
        room = RoomBuilder(room_id=old_room)
        [leaf] = await store.get_forward_extremities(old_room)
        depth = (await store.get_event(leaf))["depth"]
        room.resume(leaf, depth, await store.get_state_ids(leaf))
        fresh = RoomBuilder(room_id=f"!fresh{run}:example.org")
        batch = [
            room.message(room.creator, f"after crash {run}"),
            room.state("m.room.topic", "", {"topic": f"t{run}"}),
            fresh.create(),
            fresh.join(fresh.creator),
        ]
        results = await store.persist_events(
            [room.to_persist(e) for e in batch[:2]] + [fresh.to_persist(e) for e in batch[2:]]
        )
        orderings = [r.stream_ordering for r in results]
        self.assertFalse(any(r.already_persisted for r in results))
        self.assertEqual(len(set(orderings)), len(orderings))
        self.assertGreater(min(orderings), newest)
        self.assertEqual((await store.get_state_ids(batch[1].event_id))[("m.room.topic", "")], batch[1].event_id)
        self.assertEqual(await store.get_current_state_ids(old_room), await store.get_state_ids(batch[1].event_id))
        return {e.event_id for e in batch}, intents[-1][0] in stored
