"""Stream ID generators: the streams-doc semantics, persistence, recovery, multi-writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.streams import (
    BackingTable,
    SequenceLagError,
    StreamConfigError,
    StreamIdGenerator,
    reserve_in_transaction,
    reserve_together,
)
from tests.db import DatabaseTestMixin, on_both_engines

FACTS = BackingTable(table="facts", id_column="stream_id", instance_column="instance_name")


def _create_facts(txn):
    txn.execute("CREATE TABLE facts (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL)")


class Reservation:
    """Drive a reservation's enter/exit by hand, to complete IDs in any order."""

    def __init__(self, cm):
        self.cm = cm

    async def reserve(self):
        return await self.cm.__aenter__()

    async def complete(self):
        await self.cm.__aexit__(None, None, None)


@on_both_engines
class SingleWriterTests:
    async def _generator(self, db=None, writers=None, instance="master"):
        db = db or await self.make_database()
        return await StreamIdGenerator.create(db, "events", instance, writers=writers)

    async def test_streams_doc_table(self):
        """The example table of docs 'Streams', row by row."""
        gen = await self._generator()
        async with gen.get_next() as first:
            self.assertEqual(first, 1)
        self.assertEqual(gen.get_current_token(), 1)  # "initially at ID 1"

        steps = {}
        for n in (2, 3):
            steps[n] = Reservation(gen.get_next())
            self.assertEqual(await steps[n].reserve(), n)
            self.assertEqual(gen.get_current_token(), 1)  # Reserve 2, Reserve 3 -> 1
        await steps[3].complete()
        self.assertEqual(gen.get_current_token(), 1)  # Complete 3 -> 1, waiting for 2
        await steps[2].complete()
        self.assertEqual(gen.get_current_token(), 3)  # Complete 2 -> jumps to 3
        for n in (4, 5, 6):
            steps[n] = Reservation(gen.get_next())
            self.assertEqual(await steps[n].reserve(), n)
            self.assertEqual(gen.get_current_token(), 3)
        await steps[5].complete()
        self.assertEqual(gen.get_current_token(), 3)  # Complete 5 -> 3
        await steps[4].complete()
        self.assertEqual(gen.get_current_token(), 5)  # Complete 4 -> 5, even though 6 pending
        await steps[6].complete()
        self.assertEqual(gen.get_current_token(), 6)  # Complete 6 -> 6
        # Single writer: per-writer, linear and maximum positions agree.
        self.assertEqual(gen.get_current_token_for_writer("master"), 6)
        self.assertEqual(gen.get_max_token(), 6)
        self.assertEqual(gen.get_positions(), {"master": 6})

    async def test_body_that_raises_still_completes(self):
        gen = await self._generator()
        with self.assertRaises(ZeroDivisionError):
            async with gen.get_next() as stream_id:
                self.assertEqual(stream_id, 1)
                raise ZeroDivisionError("the body fails")
        self.assertEqual(gen.get_current_token(), 1)
        self.assertEqual(gen.get_unfinished(), [])
        async with gen.get_next() as stream_id:
            self.assertEqual(stream_id, 2)  # never reused

    async def test_get_next_mult(self):
        gen = await self._generator()
        held = Reservation(gen.get_next_mult(3))
        ids = await held.reserve()
        self.assertEqual(ids, [1, 2, 3])
        async with gen.get_next_mult(2) as later:
            self.assertEqual(later, [4, 5])
        self.assertEqual(gen.get_current_token(), 0)  # 1..3 still pending
        await held.complete()
        self.assertEqual(gen.get_current_token(), 5)

    async def test_reserving_nothing_is_an_error(self):
        gen = await self._generator()
        for n in (0, -1):
            with self.assertRaises(ValueError):
                async with gen.get_next_mult(n):
                    pass
        self.assertEqual((gen.get_unfinished(), gen.get_current_token()), ([], 0))
        reader = await self._generator(gen.db, writers=["master"], instance="reader")
        with self.assertRaises(StreamConfigError):
            async with reader.get_next_mult(0):
                pass

    async def test_wait_for_position(self):
        gen = await self._generator()
        waiter = gen.wait_for_position(2)
        self.assertFalse(waiter.called)
        async with gen.get_next():
            pass
        self.assertFalse(waiter.called)
        async with gen.get_next():
            pass
        self.assertTrue(waiter.called)
        self.assertEqual(await waiter, 2)
        self.assertEqual(await gen.wait_for_position(1), 2)  # already there

    async def test_position_persisted_inside_the_writing_transaction(self):
        """With nothing else in flight, the transaction writing a batch's facts
        also records the position its completion reaches: no transaction of
        its own follows; with a lower ID in flight it is not offered."""
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("facts", _create_facts)
        gen = await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])

        def write_facts(txn, ids, position):
            txn.insert_many("facts", ("stream_id", "instance_name"), [(i, "master") for i in ids])
            if position is not None:
                gen.persist_position_txn(txn, position)

        async with gen.get_next_mult(3) as ids:
            position = gen.position_after(ids)
            self.assertEqual(position, 3)
            await db.run_interaction("write", write_facts, ids, position)
            before = db.query_count
        self.assertEqual(gen.get_current_token(), 3)
        await gen.flush()
        self.assertEqual(db.query_count, before, "a separate position write was issued")
        stored = await db.run_interaction(
            "read", lambda t: t.select_one_value("SELECT stream_id FROM stream_positions WHERE stream_name = 'events'")
        )
        self.assertEqual(stored, 3)

        held = Reservation(gen.get_next())
        lower = await held.reserve()
        async with gen.get_next_mult(2) as ids:
            self.assertEqual((lower, ids), (4, [5, 6]))
            self.assertIsNone(gen.position_after(ids))  # 4 is still in flight
        await held.complete()
        await gen.flush()
        stored = await db.run_interaction(
            "read", lambda t: t.select_one_value("SELECT stream_id FROM stream_positions WHERE stream_name = 'events'")
        )
        self.assertEqual(stored, 6)

    def record_interactions(self, db) -> list[str]:
        """The descriptions of ``db``'s interactions from now on, in order."""
        transactions: list[str] = []
        original = db.run_interaction

        async def recording(description, *args, **kwargs):
            transactions.append(description)
            return await original(description, *args, **kwargs)

        self.patch(db, "run_interaction", recording)
        return transactions

    async def test_reserve_together(self):
        db = await self.make_database()
        events = await StreamIdGenerator.create(db, "events", "master")
        caches = await StreamIdGenerator.create(db, "caches", "master")
        transactions = self.record_interactions(db)
        with self.assertRaises(ZeroDivisionError):
            async with reserve_together([(events, 3), (caches, 0), (caches, 1)]) as (a, none, b):
                self.assertEqual((a, none, b), ([1, 2, 3], [], [1]))
                self.assertEqual((events.get_current_token(), caches.get_current_token()), (0, 0))
                raise ZeroDivisionError("the body fails")
        # Completed although the body raised; PostgreSQL read both sequences in one transaction.
        self.assertEqual((events.get_current_token(), caches.get_current_token()), (3, 1))
        allocations = [t for t in transactions if t.startswith("allocate_stream_ids")]
        self.assertEqual(allocations, ["allocate_stream_ids:events,caches"] if self.engine_name == "postgres" else [])
        with self.assertRaises(ValueError):
            async with reserve_together([(events, 1), (events, 2)]):
                pass
        self.assertEqual(events.get_unfinished(), [])

    async def test_reserve_in_transaction(self):
        """The IDs are taken inside the caller's transaction, counted there
        (on PostgreSQL from the sequences: no interaction of their own), with
        the position they reach written in it; a count of 0 takes nothing; a
        transaction that raises before taking takes none, one that raises
        after leaves a gap that holds the stream back neither."""
        db = await self.make_database()
        events = await StreamIdGenerator.create(db, "events", "master")
        caches = await StreamIdGenerator.create(db, "caches", "master")
        transactions = self.record_interactions(db)

        def write(txn, take, counts, fail_after=False):
            txn.execute("SELECT 1")
            ids = take(counts)
            if fail_after:
                raise ZeroDivisionError
            return "written", ids

        with self.assertRaises(KeyError):
            async with reserve_in_transaction([events, caches], "write", write, (3, 0)) as (result, (a, b)):
                self.assertEqual((result, a, b), (("written", [[1, 2, 3], []]), [1, 2, 3], []))
                # Reserved until the block ends, not complete.
                self.assertEqual(events.get_current_token(), 0)
                self.assertEqual(events.get_unfinished(), [1, 2, 3])
                raise KeyError
        self.assertEqual((events.get_current_token(), caches.get_current_token()), (3, 0))
        self.assertEqual(transactions, ["write"])
        # Nothing else was in flight: the transaction wrote the position, and
        # no position write of its own followed.
        await events.flush()
        self.assertEqual(transactions, ["write"])
        stored = await db.run_interaction(
            "read", lambda t: t.select_one_value("SELECT stream_id FROM stream_positions WHERE stream_name = 'events'")
        )
        self.assertEqual(stored, 3)

        # Another reservation in flight: no position written by the transaction.
        held = Reservation(events.get_next())
        self.assertEqual(await held.reserve(), 4)
        async with reserve_in_transaction([events, caches], "write", write, (1, 2)) as (_, (a, b)):
            self.assertEqual((a, b), ([5], [1, 2]))
        self.assertEqual((events.get_current_token(), caches.get_current_token()), (3, 2))
        await held.complete()
        self.assertEqual(events.get_current_token(), 5)

        def refuse(txn, take):
            raise ValueError("refused")

        with self.assertRaises(ValueError):
            async with reserve_in_transaction([events, caches], "refuse", refuse):
                pass
        with self.assertRaises(ZeroDivisionError):
            async with reserve_in_transaction([events, caches], "fail", write, (2, 0), True):
                pass
        self.assertEqual((events.get_unfinished(), caches.get_unfinished()), ([], []))
        # The failed transaction's IDs (6, 7) are dropped: not counted complete,
        # since a restarted server may hand them out again.
        self.assertEqual(events.get_current_token(), 5)
        async with events.get_next() as next_id:
            # The refusal took none; the failure after taking left a gap (6, 7).
            self.assertEqual(next_id, 8)
        self.assertEqual(events.get_current_token(), 8)
        with self.assertRaises(ValueError):
            async with reserve_in_transaction([events, caches], "bad", write, (1,)):
                pass
        with self.assertRaises(ValueError):
            async with reserve_in_transaction([events, events], "twice", write, (1, 1)):
                pass
        self.assertEqual(events.get_unfinished(), [])

    async def test_reader_starts_from_persisted_position_not_newest_row(self):
        """A process that only reads the stream, starting while the writer has
        ID 1 in flight and 2 written, must not claim 1 complete."""
        db = await self.make_database()
        await db.run_interaction("facts", _create_facts)
        writer = await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])
        held = Reservation(writer.get_next())
        self.assertEqual(await held.reserve(), 1)
        async with writer.get_next() as stream_id:
            await db.run_interaction(
                "fact", lambda t: t.execute("INSERT INTO facts VALUES (?, 'master')", (stream_id,))
            )
        reader = await StreamIdGenerator.create(db, "events", "reader", writers=["master"], backing_tables=[FACTS])
        self.assertEqual(reader.get_current_token(), 0)
        await held.complete()
        await writer.flush()
        later = await StreamIdGenerator.create(db, "events", "reader", writers=["master"], backing_tables=[FACTS])
        self.assertEqual(later.get_current_token(), 2)

    async def test_restart_recovers_persisted_position(self):
        url = self.new_database_url()
        db = await self.make_database(url)
        gen = await self._generator(db)
        for _ in range(5):
            async with gen.get_next():
                pass
        await gen.flush()
        stored = await db.run_interaction(
            "read", lambda t: t.select_one_value("SELECT stream_id FROM stream_positions WHERE stream_name = 'events'")
        )
        self.assertEqual(stored, 5)
        await db.close()

        db2 = await self.make_database(url)
        gen2 = await self._generator(db2)
        self.assertEqual(gen2.get_current_token(), 5)
        async with gen2.get_next() as stream_id:
            self.assertEqual(stream_id, 6)

    async def test_restart_recovers_from_backing_table_when_position_lagged(self):
        """A crash after a fact committed but before its position was written:
        start-up finds the fact in the backing table and never reuses its ID."""
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("facts", _create_facts)
        gen = await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])
        async with gen.get_next() as stream_id:
            await db.run_interaction(
                "fact", lambda t: t.execute("INSERT INTO facts VALUES (?, 'master')", (stream_id,))
            )
        await gen.flush()
        # Facts 2..4 committed, but the position write never happened.
        async with gen.get_next_mult(3) as ids:
            await db.run_interaction(
                "facts", lambda t: t.insert_many("facts", ("stream_id", "instance_name"), [(i, "master") for i in ids])
            )
        await db.run_interaction(
            "undo_position",
            lambda t: t.execute("UPDATE stream_positions SET stream_id = 1 WHERE stream_name = 'events'"),
        )
        await db.close()

        db2 = await self.make_database(url)
        gen2 = await StreamIdGenerator.create(db2, "events", "master", backing_tables=[FACTS])
        self.assertEqual(gen2.get_current_token(), 4)
        async with gen2.get_next() as stream_id:
            self.assertEqual(stream_id, 5)

    async def test_multi_writer_needs_postgres(self):
        db = await self.make_database()
        if self.engine_name == "sqlite":
            with self.assertRaises(StreamConfigError) as caught:
                await StreamIdGenerator.create(db, "events", "w1", writers=["w1", "w2"])
            self.assertIn("needs PostgreSQL", str(caught.exception))
        else:
            gen = await StreamIdGenerator.create(db, "events", "w1", writers=["w1", "w2"])
            self.assertEqual(gen.writers, ("w1", "w2"))

    async def test_non_writer_cannot_reserve(self):
        db = await self.make_database()
        reader = await StreamIdGenerator.create(db, "events", "reader", writers=["master"])
        with self.assertRaises(StreamConfigError):
            async with reader.get_next():
                pass

    async def test_reader_advance(self):
        db = await self.make_database()
        reader = await StreamIdGenerator.create(db, "events", "reader", writers=["master"])
        waiter = reader.wait_for_position(7, "master")
        reader.advance("master", 3)
        self.assertFalse(waiter.called)
        reader.advance("master", 2)  # never backwards
        self.assertEqual(reader.get_current_token_for_writer("master"), 3)
        reader.advance("master", 7)
        self.assertEqual(await waiter, 7)
        reader.advance("stranger", 100)  # unknown writer: ignored
        self.assertEqual(reader.get_positions(), {"master": 7})

    async def test_position_gauges_follow_advance(self):
        """The gauges read the positions when scraped, so they follow every
        advance with no work per advance."""
        from prometheus_client import REGISTRY

        db = await self.make_database()
        reader = await StreamIdGenerator.create(db, "events", "reader", writers=["master"])
        reader.advance("master", 41)
        self.assertEqual(
            REGISTRY.get_sample_value("roomstore_stream_position", {"stream": "events", "writer": "master"}), 41
        )
        self.assertEqual(REGISTRY.get_sample_value("roomstore_stream_linear_position", {"stream": "events"}), 41)

    async def test_ids_never_repeat_after_restart_without_flush(self):
        """SQLite's in-process counter (and PostgreSQL's sequence) continue
        past every ID recorded in the backing table."""
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("facts", _create_facts)
        gen = await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])
        async with gen.get_next_mult(10) as ids:
            await db.run_interaction(
                "facts", lambda t: t.insert_many("facts", ("stream_id", "instance_name"), [(i, "master") for i in ids])
            )
        await db.close()  # no flush
        db2 = await self.make_database(url)
        gen2 = await StreamIdGenerator.create(db2, "events", "master", backing_tables=[FACTS])
        async with gen2.get_next() as stream_id:
            self.assertGreater(stream_id, 10)


class PostgresOnly(DatabaseTestMixin, unittest.TestCase):
    """Multi-writer behaviour: needs shared sequences, so PostgreSQL only."""

    engine_name = "postgres"

    async def test_two_writers_in_separate_connections(self):
        url = self.new_database_url()
        db_a = await self.make_database(url)
        db_b = await self.make_database(url, prepare=False)
        a = await StreamIdGenerator.create(db_a, "events", "a", writers=["a", "b"])
        b = await StreamIdGenerator.create(db_b, "events", "b", writers=["a", "b"])

        held_a = Reservation(a.get_next())
        id_a1 = await held_a.reserve()
        async with b.get_next() as id_b1:
            pass
        async with a.get_next() as id_a2:
            pass
        self.assertEqual([id_a1, id_b1, id_a2], [1, 2, 3])
        # a has 1 in flight: its own position stays below it.
        self.assertEqual(a.get_current_token_for_writer("a"), 0)
        self.assertEqual(b.get_current_token_for_writer("b"), 2)
        await held_a.complete()
        self.assertEqual(a.get_current_token_for_writer("a"), 3)

        # Each learns the other's position, as replication would tell it.
        a.advance("b", b.get_current_token_for_writer("b"))
        b.advance("a", a.get_current_token_for_writer("a"))
        self.assertEqual(a.get_current_token(), 2)
        self.assertEqual(b.get_current_token(), 3)  # b idle: it moves up with a
        self.assertEqual(a.get_max_token(), 3)
        # b is idle, so telling a about b's idle bump lines them up.
        a.advance("b", b.get_current_token_for_writer("b"))
        self.assertEqual(a.get_positions(), b.get_positions())
        self.assertEqual(a.get_positions(), {"a": 3, "b": 3})

    async def test_writer_moved_up_while_idle_then_killed_restarts_at_least_there(self):
        """Issue 24's sequence at the generator: a writes, b writes past it,
        a (idle) moves up with b and persists that, a dies without closing;
        restarted, a starts at or above what it persisted (the anomaly was
        the Redis announcer's, tests/replication/test_redis_positions.py)."""
        url = self.new_database_url()
        db_a = await self.make_database(url)
        await db_a.run_interaction("facts", _create_facts)
        db_b = await self.make_database(url, prepare=False)
        a = await StreamIdGenerator.create(db_a, "events", "a", writers=["a", "b"], backing_tables=[FACTS])
        b = await StreamIdGenerator.create(db_b, "events", "b", writers=["a", "b"], backing_tables=[FACTS])

        async def write(gen, db, n):
            async with gen.get_next_mult(n) as ids:
                await db.run_interaction(
                    "facts",
                    lambda t: t.insert_many(
                        "facts", ("stream_id", "instance_name"), [(i, gen.instance_name) for i in ids]
                    ),
                )

        await write(a, db_a, 3)
        await write(b, db_b, 5)
        await b.flush()
        a.advance("b", b.get_current_token_for_writer("b"))
        self.assertEqual(a.get_current_token_for_writer("a"), 8)  # idle: moved up with b
        await a.flush()
        self.assertEqual((await a.read_persisted_positions())["a"], 8)
        held = Reservation(b.get_next())
        self.assertEqual(await held.reserve(), 9)  # b has 9 in flight when a dies
        await db_a.close()  # killed: no close() of the generator

        db_a2 = await self.make_database(url, prepare=False)
        restarted = await StreamIdGenerator.create(db_a2, "events", "a", writers=["a", "b"], backing_tables=[FACTS])
        self.assertGreaterEqual(restarted.get_current_token_for_writer("a"), 8)
        self.assertEqual(restarted.get_current_token_for_writer("b"), 8)  # b's persisted, not its in-flight 9
        await held.complete()
        async with restarted.get_next() as stream_id:
            self.assertEqual(stream_id, 10)

    async def test_sequence_lag_is_detected(self):
        db = await self.make_database()
        await db.run_interaction("facts", _create_facts)
        await db.run_interaction("facts", lambda t: t.execute("INSERT INTO facts VALUES (50, 'master')"))
        with self.assertRaises(SequenceLagError) as caught:
            await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])
        self.assertIn("setval('events_stream_seq', 50)", str(caught.exception))
        await db.run_interaction("fix", lambda t: t.execute("SELECT setval('events_stream_seq', 50)"))
        gen = await StreamIdGenerator.create(db, "events", "master", backing_tables=[FACTS])
        async with gen.get_next() as stream_id:
            self.assertEqual(stream_id, 51)

    async def test_two_processes_reserve_ten_thousand_each(self):
        """Two OS processes, each reserving 10,000 IDs with get_next_mult and
        writing a fact per ID: no duplicate, no gap, and after exchanging
        positions with advance both agree."""
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("facts", _create_facts)
        script = os.path.join(os.path.dirname(__file__), "two_writer_worker.py")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
        procs = [
            subprocess.Popen(
                [sys.executable, script, url, name, other, "10000"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            for name, other in (("w1", "w2"), ("w2", "w1"))
        ]
        outputs = []
        for proc in procs:
            out, err = await threads.deferToThread(proc.communicate, timeout=300)
            self.assertEqual(proc.returncode, 0, err.decode())
            outputs.append(json.loads(out.decode().strip().splitlines()[-1]))

        ids = await db.run_interaction(
            "ids", lambda t: [r[0] for r in t.execute("SELECT stream_id FROM facts ORDER BY stream_id").fetchall()]
        )
        self.assertEqual(len(ids), 20_000)
        self.assertEqual(len(set(ids)), 20_000, "duplicate stream IDs")
        self.assertEqual(ids, list(range(1, 20_001)), "a gap in the stream")
        self.assertEqual(outputs[0]["positions"], outputs[1]["positions"])
        self.assertEqual(outputs[0]["positions"], {"w1": 20_000, "w2": 20_000})
        self.assertEqual(outputs[0]["unfinished"], [])
