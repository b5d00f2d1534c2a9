"""StateGroupStore's full-state reads on hand-written chains, on both engines:
the nearest row of each key wins, a NULL event (written by compaction) removes
the key, and the filtered read agrees with the full one. The read packs each
group's rows into one value (``packed_full_state_sql``) and, on PostgreSQL,
takes a one-row delta from the group's own row (``state_groups.sole_*``):
large random chains check the store's read, with and without those copies,
against the row-per-entry statement and a plain Python replay, on both
engines."""

from __future__ import annotations

import random

from roomstore.state.groups import (
    FULL_STATE_SQL,
    StateGroupNotFound,
    StateGroupStore,
    fold_state,
    packed_full_state_sql,
)
from roomstore.storage.schema import prepare_database
from tests.db import INTEGRITY_ERRORS, on_both_engines, refresh_sole_delta_sql, sole_delta_mismatches_txn

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
            # Mostly one row (one state event), as in a room's history.
            for key in rng.sample(keys, rng.choice([0, 1, 1, 1, 2, rng.randrange(0, 300)])):
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


def write_groups_txn(txn, group_rows, delta_rows, sole: bool = True) -> None:
    """:func:`random_chain`'s rows into the tables; with ``sole``, one-row
    deltas copied into their groups' rows as the store's writers do."""
    txn.insert_many("state_groups", ("state_group", "room_nid", "prev_state_group", "chain_length"), group_rows)
    txn.insert_many("state_group_deltas", ("state_group", "type_key_nid", "event_nid"), delta_rows)
    if sole:
        txn.execute(refresh_sole_delta_sql("SELECT state_group FROM state_groups"))


@on_both_engines
class PackedStateReadTests:
    async def test_large_random_chains_match_the_row_read_and_a_replay(self):
        db = await self.make_database()
        expected = {}
        for seed in (1, 2):
            group_rows, delta_rows, states = random_chain(seed)
            expected.update(states)
            await db.run_interaction("write", write_groups_txn, group_rows, delta_rows, sole=False)
        groups = StateGroupStore()

        def read_both(txn, group):
            groups.forget(group)
            rows = fold_state(txn.execute(FULL_STATE_SQL, (group,)).fetchall())
            return groups.get_state(txn, group), rows

        # First with no copies (NULL: every group's rows are read), then with
        # them (PostgreSQL reads one-row deltas from the groups' rows).
        for copies in (False, True):
            if copies:
                await db.run_interaction(
                    "copies", lambda t: t.execute(refresh_sole_delta_sql("SELECT state_group FROM state_groups"))
                )
                self.assertEqual(await db.run_interaction("check", sole_delta_mismatches_txn), [])
                with_sole = await db.run_interaction(
                    "count",
                    lambda t: t.select_one_value(
                        "SELECT COUNT(*) FROM state_groups WHERE sole_type_key_nid IS NOT NULL"
                    ),
                )
                self.assertGreater(with_sole, 10)
            for group, state in expected.items():
                packed, rows = await db.run_interaction("read", read_both, group)
                self.assertEqual(packed, state, (group, copies))
                self.assertEqual(rows, state, (group, copies))

    async def test_a_sole_removal_and_an_empty_group(self):
        """A one-row delta that removes a key (NULL event) and a group with no
        rows at all read the same from the copy as from the rows."""
        db = await self.make_database()

        def write(txn):
            write_chain_txn(txn)
            txn.execute(
                "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length)"
                " VALUES (80, 1, 10, 4), (90, 1, 80, 5)"
            )
            txn.execute("INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid) VALUES (80, 6, NULL)")
            txn.execute(refresh_sole_delta_sql("SELECT state_group FROM state_groups"))
            return txn.execute(
                "SELECT state_group, sole_type_key_nid, sole_event_nid FROM state_groups"
                " WHERE state_group IN (80, 90) ORDER BY state_group"
            ).fetchall()

        self.assertEqual(
            [tuple(r) for r in await db.run_interaction("write", write)], [(80, 6, None), (90, None, None)]
        )
        after = {k: v for k, v in EXPECTED[10].items() if k != 6}
        for group, state in ((80, after), (90, after), *EXPECTED.items()):
            self.assertEqual(await db.run_interaction("read", StateGroupStore().get_state, group), state, group)

    async def test_packed_ints_keep_order_nulls_and_64_bit_values(self):
        db = await self.make_database()
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
        self.assertEqual(sorted(zip(*columns, strict=True), key=repr), sorted(values, key=repr))
        self.assertEqual(list(zip(*empty, strict=True)), [])


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
        with self.assertRaises(INTEGRITY_ERRORS):
            await db.run_interaction(
                "dup",
                lambda t: t.execute(
                    "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length)"
                    " VALUES (50, 1, NULL, 0)"
                ),
            )
        # The walk at version 5 (the row statement), then the store's read
        # once upgraded to the code's version.
        for group, expected in EXPECTED.items():
            rows = await db.run_interaction("rows", lambda t: t.execute(FULL_STATE_SQL, (group,)).fetchall())
            self.assertEqual(fold_state([tuple(r) for r in rows]), expected, group)
        await db.run_interaction("upgrade", prepare_database)
        groups = StateGroupStore()
        for group, expected in EXPECTED.items():
            self.assertEqual(await db.run_interaction("read", groups.get_state, group), expected, group)

    async def test_version_6_copies_one_row_deltas_into_their_groups(self):
        """Upgrading a version 5 database fills ``state_groups.sole_*`` for
        exactly the groups of one row (a removal included), and every state
        reads the same."""
        db = await self.make_database(prepare=False)
        self.assertEqual(await db.run_interaction("to 5", prepare_database, None, 5), 5)

        def write(txn):
            write_chain_txn(txn)
            txn.execute(
                "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length)"
                " VALUES (80, 1, 10, 4), (90, 1, 80, 5), (95, 1, 90, 6)"
            )
            txn.execute(
                "INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid)"
                " VALUES (80, 6, NULL), (90, 7, 707)"
            )

        await db.run_interaction("write", write)
        self.assertEqual(await db.run_interaction("to 6", prepare_database, None, 6), 6)
        rows = await db.run_interaction(
            "sole",
            lambda t: t.execute(
                "SELECT state_group, sole_type_key_nid, sole_event_nid FROM state_groups"
                " WHERE sole_type_key_nid IS NOT NULL OR sole_event_nid IS NOT NULL ORDER BY state_group"
            ).fetchall(),
        )
        self.assertEqual([tuple(r) for r in rows], [(80, 6, None), (90, 7, 707)])
        self.assertEqual(await db.run_interaction("check", sole_delta_mismatches_txn), [])
        after = {k: v for k, v in EXPECTED[10].items() if k != 6}
        for group, state in ((80, after), (90, {**after, 7: 707}), (95, {**after, 7: 707}), *EXPECTED.items()):
            self.assertEqual(await db.run_interaction("read", StateGroupStore().get_state, group), state, group)

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
            # 30 groups: the planner would hash the whole table at each step;
            # on a real table it probes the key (a nested loop), the plan
            # checked here.
            txn.execute("SET LOCAL enable_seqscan = off")
            txn.execute("SET LOCAL enable_hashjoin = off")
            txn.execute("SET LOCAL enable_mergejoin = off")
            sql = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + packed_full_state_sql(txn.engine)
            text = "\n".join(r[0] for r in txn.execute(sql, (group_rows[-1][0],)).fetchall())
            probed = txn.select_one_value("SELECT COUNT(*) FROM state_groups WHERE sole_type_key_nid IS NULL")
            return text, probed

        text, probed = await db.run_interaction("plan", plan)
        self.assertIn("Index Only Scan using state_groups_pkey on state_groups", text)
        self.assertIn("Heap Fetches: 0", text)
        self.assertNotIn("Heap Fetches: 1", text)
        # state_group_deltas is probed once per group without a copy of its
        # one row (the chain is all 30 groups), and never for the others.
        self.assertGreater(30 - probed, 5)
        deltas = [line for line in text.splitlines() if "on state_group_deltas" in line]
        self.assertTrue(deltas, text)
        for line in deltas:
            self.assertIn(f"loops={probed})", line, text)
