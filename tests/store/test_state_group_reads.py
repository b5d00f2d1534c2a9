"""StateGroupStore's full-state reads on hand-written chains, on both engines:
the nearest row of each key wins, a NULL event (written by compaction) removes
the key, and the filtered read agrees with the full one. On SQLite the read
packs each group's rows into one value (``packed_full_state_sql``): large
random chains check the store's read against the row-per-entry statement and
a plain Python replay, on both engines."""

from __future__ import annotations

import random

from roomstore.state.groups import FULL_STATE_SQL, StateGroupNotFound, StateGroupStore, fold_state
from roomstore.storage.schema import prepare_database
from tests.db import on_both_engines

# group -> (prev group, {type_key_nid: event_nid or None}); ids deliberately not
# in chain order, so nothing may rely on a predecessor having a smaller id.
CHAIN = {
    50: (None, {1: 101, 2: 102, 3: 103, 4: 104}),
    20: (50, {2: 202, 5: 205}),
    70: (20, {2: 302, 3: None}),
    10: (70, {3: 403, 4: None, 6: 406}),
}
EXPECTED = {
    50: {1: 101, 2: 102, 3: 103, 4: 104},
    20: {1: 101, 2: 202, 3: 103, 4: 104, 5: 205},
    70: {1: 101, 2: 302, 4: 104, 5: 205},
    10: {1: 101, 2: 302, 3: 403, 5: 205, 6: 406},
}


def write_chain_txn(txn) -> None:
    for group, (prev, delta) in CHAIN.items():
        txn.execute(
            "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length) VALUES (?, 1, ?, 0)",
            (group, prev),
        )
        for key, event in delta.items():
            txn.execute(
                "INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid) VALUES (?, ?, ?)",
                (group, key, event),
            )


@on_both_engines
class StateGroupReadTests:
    async def test_nearest_row_wins_and_null_removes(self):
        db = await self.make_database()
        await db.run_interaction("write", write_chain_txn)
        groups = StateGroupStore()
        for group, expected in EXPECTED.items():
            state = await db.run_interaction("read", groups.get_state, group)
            self.assertEqual(state, expected, group)
            for keys in ([2, 3, 4], [3], [4, 6, 99]):
                filtered = await db.run_interaction("read", groups.get_state_filtered, group, keys)
                self.assertEqual(filtered, {k: v for k, v in expected.items() if k in keys}, (group, keys))

    async def test_unknown_group(self):
        db = await self.make_database()
        with self.assertRaises(StateGroupNotFound):
            await db.run_interaction("read", StateGroupStore().get_state, 12345)


def random_chain(seed: int, groups: int = 40, snapshot_keys: int = 5000):
    """(rows of state_groups, rows of state_group_deltas, expected states) of
    one long chain: a big snapshot, then deltas that add, change and remove
    keys; group ids shuffled, keys up to 2**31, events up to 2**62."""
    rng = random.Random(seed)
    ids = rng.sample(range(1000, 100_000), groups)
    keys = rng.sample(range(1, 1 << 31), snapshot_keys + 2000)  # type_key_nid: INTEGER on PostgreSQL
    state = {key: rng.randrange(1, 1 << 62) for key in keys[:snapshot_keys]}
    group_rows, delta_rows, expected = [], [], {}
    prev = None
    for index, group in enumerate(ids):
        if prev is None:
            delta = dict(state)
        else:
            delta = {}
            for key in rng.sample(keys, rng.randrange(0, 300)):
                delta[key] = None if key in state and rng.random() < 0.3 else rng.randrange(1, 1 << 62)
            for key, event in delta.items():
                if event is None:
                    state.pop(key, None)
                else:
                    state[key] = event
        group_rows.append((group, 1, prev, index))
        delta_rows += [(group, key, event) for key, event in delta.items()]
        expected[group] = dict(state)
        prev = group
    return group_rows, delta_rows, expected


def write_groups_txn(txn, group_rows, delta_rows) -> None:
    """:func:`random_chain`'s rows into the tables."""
    txn.insert_many("state_groups", ("state_group", "room_nid", "prev_state_group", "chain_length"), group_rows)
    txn.insert_many("state_group_deltas", ("state_group", "type_key_nid", "event_nid"), delta_rows)


@on_both_engines
class PackedStateReadTests:
    async def test_large_random_chains_match_the_row_read_and_a_replay(self):
        db = await self.make_database()
        expected = {}
        for seed in (1, 2):
            group_rows, delta_rows, states = random_chain(seed)
            expected.update(states)
            await db.run_interaction("write", write_groups_txn, group_rows, delta_rows)
        groups = StateGroupStore()

        def read_both(txn, group):
            rows = fold_state(txn.execute(FULL_STATE_SQL, (group,)).fetchall())
            return groups.get_state(txn, group), rows

        for group, state in expected.items():
            packed, rows = await db.run_interaction("read", read_both, group)
            self.assertEqual(packed, state, group)
            self.assertEqual(rows, state, group)

    async def test_packed_ints_keep_order_nulls_and_64_bit_values(self):
        db = await self.make_database()
        if not db.engine.packs_rows:
            with self.assertRaises(NotImplementedError):
                db.engine.packed_ints_sql(["a"])
            return
        values = [(3, None), (-(1 << 63), 1 << 62), ((1 << 63) - 1, 7), (1, 2)]

        def read(txn):
            engine = txn.engine
            marks = " UNION ALL ".join("SELECT CAST(? AS BIGINT) AS a, CAST(? AS BIGINT) AS b" for _ in values)
            args = [v for pair in values for v in pair]
            packed = txn.execute(f"SELECT {engine.packed_ints_sql(['a', 'b'])} FROM ({marks}) AS v", args).fetchone()[0]
            empty = txn.execute(
                f"SELECT {engine.packed_ints_sql(['a', 'b'])} FROM ({marks}) AS v WHERE a = 5", args
            ).fetchone()[0]
            return engine.unpack_ints(packed), engine.unpack_ints(empty)

        columns, empty = await db.run_interaction("read", read)
        self.assertEqual(sorted(zip(*columns), key=repr), sorted(values, key=repr))
        self.assertEqual(list(zip(*empty)), [])


@on_both_engines
class StateGroupWalkIndexTests:
    timeout = 120

    async def test_version_5_keeps_every_chain_readable(self):
        """Upgrading a version 4 database (PostgreSQL: the primary key gets
        prev_state_group INCLUDEd; SQLite: nothing) keeps every state, and the
        key still refuses a duplicate group."""
        db = await self.make_database(prepare=False)
        self.assertEqual(await db.run_interaction("to 4", prepare_database, None, 4), 4)
        await db.run_interaction("write", write_chain_txn)
        self.assertEqual(await db.run_interaction("to 5", prepare_database, None, 5), 5)
        groups = StateGroupStore()
        for group, expected in EXPECTED.items():
            self.assertEqual(await db.run_interaction("read", groups.get_state, group), expected, group)
        with self.assertRaises(Exception):
            await db.run_interaction("dup", lambda t: t.execute(
                "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length) VALUES (50, 1, NULL, 0)"))

    async def test_the_walk_is_index_only_on_postgresql(self):
        """After VACUUM (what autovacuum does on a running server) each hop of
        the walk reads the primary key's index and no table page."""
        if self.engine_name != "postgres":
            return  # SQLite: a rowid table, the key lookup is the row
        db = await self.make_database()
        group_rows, delta_rows, _ = random_chain(3, groups=30, snapshot_keys=50)
        await db.run_interaction("write", write_groups_txn, group_rows, delta_rows)
        conn = db.engine.session_connection("walk-index-test")
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            # The test server commits asynchronously (synchronous_commit=off),
            # and vacuum does not mark a page all-visible before the WAL of its
            # rows' commit is on disk: a checkpoint writes it.
            cur.execute("CHECKPOINT")
            cur.execute("VACUUM ANALYZE state_groups")

        def plan(txn):
            txn.execute("SET LOCAL enable_seqscan = off")
            sql = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + FULL_STATE_SQL
            return "\n".join(r[0] for r in txn.execute(sql, (group_rows[-1][0],)).fetchall())

        text = await db.run_interaction("plan", plan)
        self.assertIn("Index Only Scan using state_groups_pkey on state_groups", text)
        self.assertIn("Heap Fetches: 0", text)
