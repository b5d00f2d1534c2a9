"""The Synapse layout's ordered read (no shuffle): rooms cut into partitions,
each room's rows together and sorted by PostgreSQL, and the executor adapter
that runs the room function over such a partition room by room."""

from __future__ import annotations

import os

import pyarrow as pa
from twisted.trial import unittest

from roomstore.compaction.job.executor import ChunkError, whole_rooms
from roomstore.compaction.synapse_tables import room_partitions


def _batch(nids: list[int], values: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"room_nid": pa.array(nids, pa.int64()), "v": pa.array(values, pa.int64())})


class RoomPartitionsTests(unittest.TestCase):
    def test_whole_rooms_in_order_about_equal_shares(self) -> None:
        sizes = [(1, 10, 5), (2, 20, 50), (3, 30, 5), (4, 40, 5)]
        self.assertEqual(room_partitions(sizes, 2), [[(1, 10)], [(2, 20)], [(3, 30), (4, 40)]])
        self.assertEqual(room_partitions(sizes, 1), [[(1, 10), (2, 20), (3, 30), (4, 40)]])
        many = [(n, n * 10, 1 + n % 7) for n in range(1, 200)]
        parts = room_partitions(many, 8)
        self.assertEqual([room for part in parts for room in part], [(n, f) for n, f, _ in many])
        share = -(-sum(n for _, _, n in many) // 8)
        sizes_of = {n: s for n, _, s in many}
        for part in parts:
            self.assertTrue(len(part) == 1 or sum(sizes_of[n] for n, _ in part) <= share, part)
        self.assertEqual(room_partitions([], 4), [])
        # A smaller first partition: its results come first, so the writes start sooner.
        small_first = room_partitions(many, 8, first_share=0.25)
        self.assertEqual([room for part in small_first for room in part], [(n, f) for n, f, _ in many])
        self.assertLessEqual(sum(sizes_of[n] for n, _ in small_first[0]), share // 4)
        self.assertGreater(sum(sizes_of[n] for n, _ in small_first[0]), share // 4 - 7)
        for part in small_first[1:]:
            self.assertTrue(len(part) == 1 or sum(sizes_of[n] for n, _ in part) <= share, part)


class WholeRoomsTests(unittest.TestCase):
    def test_each_room_gets_its_rows_in_order_across_batch_edges(self) -> None:
        calls = []

        def room_function(key, batches):
            rows = [v for b in batches for v in b.column("v").to_pylist()]
            calls.append((key[0].as_py(), rows))
            yield _batch([key[0].as_py()], [len(rows)])

        batches = [_batch([7, 7, 3], [1, 2, 3]), _batch([3, 3], [4, 5]), _batch([], []), _batch([9], [6])]
        out = list(whole_rooms(room_function)(iter(batches)))
        self.assertEqual(calls, [(7, [1, 2]), (3, [3, 4, 5]), (9, [6])])
        self.assertEqual([b.column("v").to_pylist() for b in out], [[2], [3], [1]])

    def test_a_room_in_two_runs_stops_the_partition(self) -> None:
        def room_function(key, batches):
            for _ in batches:
                pass
            yield _batch([key[0].as_py()], [0])

        with self.assertRaises(ChunkError):
            list(whole_rooms(room_function)(iter([_batch([1, 2, 1], [1, 2, 3])])))


class OrderedSqlTests(unittest.TestCase):
    """On a Synapse-made database: the ordered read returns exactly the rows of
    the shuffled read (group rows and boundary states), room by room, sorted by
    ``(sort_id, kind)`` within each room."""

    def test_same_rows_as_the_shuffled_read_each_room_together_and_sorted(self) -> None:
        from roomstore.compaction import synapse_sql as sql
        from roomstore.compaction.synapse_tables import SynapseTables
        from roomstore.compaction.write_back import CompactionWriter
        from tests.compaction.test_synapse_job import exclusive, insert_chain_room, synapse_server
        from tests.db import pg_query

        server = synapse_server()
        self.addCleanup(exclusive(server).close)
        dsn = server.database
        tag = os.urandom(3).hex()
        rooms = [f"!ordered{tag}{n}:synapse.test" for n in range(3)]
        for n, room in enumerate(rooms):
            insert_chain_room(dsn, room, 130 + 40 * n, seed=90 + n)
        writer = CompactionWriter(dsn, tables=SynapseTables(), heartbeat_s=0)
        self.addCleanup(writer.close)
        nids = sorted(writer.room_nids(rooms).values())
        where = "{col} IN (" + ", ".join(str(n) for n in nids) + ")"
        snap = writer.max_state_group()
        sizes = writer.tables.room_sizes(writer.db, snap, where)
        self.assertEqual(sorted(n for n, _, _ in sizes), nids)
        starts, links = writer.chunk_layout(snap, 50, where.format(col="room_nid"))
        needs = [(room, 0 if chunk == 0 else starts[room][chunk - 1], prev) for room, chunk, prev in links]
        self.assertTrue(needs)
        boundary = sorted({b for _, _, b in needs})

        ordered = pg_query(dsn, sql.jdbc_ordered_rows(snap, where, [f for _, f, _ in sizes], needs, boundary))
        # Each room's rows together, sorted by (sort_id, kind).
        seen, previous = [], None
        for row in ordered:
            if row[0] != previous:
                self.assertNotIn(row[0], seen)
                seen.append(row[0])
                previous = row[0]
        for nid in nids:
            keys = [(r[1], r[2]) for r in ordered if r[0] == nid]
            self.assertEqual(keys, sorted(keys))
        # The group rows are the shuffled read's rows.
        groups = pg_query(
            dsn,
            "SELECT room_nid, state_group, 1, state_group, prev_state_group, type, state_key,"
            " event_id, row_checksum FROM " + sql.jdbc_group_rows(snap, where),
        )
        self.assertEqual(sorted((r for r in ordered if r[2] == 1), key=repr), sorted(groups, key=repr))
        # The boundary rows are each needed group's full state, placed at its chunk.
        states = pg_query(dsn, sql.full_states(boundary))
        expected = [
            (room, sort_id, 0, b, None, t, k, e, None)
            for room, sort_id, b in needs
            for bg, t, k, e in states
            if bg == b
        ]
        self.assertEqual(sorted((r for r in ordered if r[2] == 0), key=repr), sorted(expected, key=repr))
        # The reads' connections plan it with index lookups only (synapse_sql.READ_OPTIONS): the same rows, in the
        # same order of room, sort_id and kind (rows alike in all three, a group's state entries, in any order).
        import psycopg2

        conn = psycopg2.connect(dsn, options=sql.READ_OPTIONS)
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            cur.execute("SHOW enable_seqscan")
            self.assertEqual(cur.fetchone()[0], "off")
            cur.execute(sql.jdbc_ordered_rows(snap, where, [f for _, f, _ in sizes], needs, boundary))
            rows = cur.fetchall()
            self.assertEqual([r[:3] for r in rows], [r[:3] for r in ordered])
            self.assertEqual(sorted(rows, key=repr), sorted(ordered, key=repr))

    def test_the_reads_connections_run_without_jit_and_with_index_lookups(self) -> None:
        from roomstore.compaction import synapse_sql as sql
        from roomstore.compaction.job.jdbc import jdbc_url
        from roomstore.compaction.job.reading import JdbcSource
        from roomstore.storage.engines import engine_from_url

        url, props = jdbc_url(engine_from_url("postgresql://u@db.test:5433/synapse?options=-c%20statement_timeout%3D0"))
        self.assertEqual(url, "jdbc:postgresql://db.test:5433/synapse")
        # JIT off first, so the URL's own options (after it) can turn it back on.
        self.assertEqual(props["options"], "-c jit=off -c statement_timeout=0")
        self.assertEqual(jdbc_url(engine_from_url("postgresql://u@db.test/synapse"))[1]["options"], "-c jit=off")
        source = JdbcSource.from_db_url("postgresql://u@db.test/synapse")
        from roomstore.compaction.synapse_tables import SynapseTables

        read = SynapseTables.read_source(source)
        self.assertEqual(read.properties["options"], "-c jit=off " + sql.READ_OPTIONS)
        self.assertEqual(read.properties["user"], "u")
        self.assertEqual(source.properties["options"], "-c jit=off")  # the source itself unchanged
