"""What a transaction learned (``Transaction.memo``) spares its later steps a
statement, and a trial run's rollback takes its lessons back; ids of several
tables reserved at once (``Transaction.reserve_ids``). Both engines."""

from __future__ import annotations

from roomstore.storage.interning import Interners
from tests.db import on_both_engines


def recording(txn) -> list[str]:
    """The statements ``txn`` runs from now on (reads and inserts alike)."""
    statements: list[str] = []
    execute, insert_many = txn.execute, txn.insert_many

    def counted_execute(sql, *args, **kwargs):
        statements.append(sql)
        return execute(sql, *args, **kwargs)

    def counted_insert_many(table, *args, **kwargs):
        statements.append(f"insert into {table}")
        return insert_many(table, *args, **kwargs)

    txn.execute, txn.insert_many = counted_execute, counted_insert_many
    return statements


@on_both_engines
class TransactionMemoTests:
    async def test_keys_interned_earlier_in_the_transaction_cost_no_statement(self):
        db = await self.make_database()
        events = Interners().events

        def steps(txn):
            statements = recording(txn)
            looked = events.lookup(txn, ["$a", "$b"])
            asked_first = len(statements)
            created: set = set()
            nids = events.intern(txn, ["$a", "$b"], created)
            after_intern = len(statements)
            again: set = set()
            second = events.intern(txn, ["$b", "$a"], again)
            third = events.lookup(txn, ["$a"])
            return looked, asked_first, created, nids, after_intern, again, second, third, len(statements)

        looked, asked_first, created, nids, after_intern, again, second, third, total = await db.run_interaction(
            "steps", steps
        )
        self.assertEqual(looked, {})
        self.assertEqual(asked_first, 1)
        self.assertEqual(created, {"$a", "$b"})
        # Inserted by this transaction: still reported as created, with the same nids.
        self.assertEqual(again, {"$a", "$b"})
        self.assertEqual(second, nids)
        self.assertEqual(third, {"$a": nids["$a"]})
        self.assertEqual(total, after_intern)  # the last two calls asked nothing
        # Nothing of the memo outlives the transaction: a new one sees the
        # committed rows (the cache learned them) and created nothing.
        later: set = set()
        self.assertEqual(await db.run_interaction("later", events.intern, ["$a", "$b"], later), nids)
        self.assertEqual(later, set())

    async def test_nids_interned_earlier_in_the_transaction_resolve_without_a_statement(self):
        """The cache learns a transaction's new nids only at its commit;
        until then ``resolve`` finds them in the memo, not in the table."""
        db = await self.make_database()
        events = Interners().events
        stored = await db.run_interaction("stored", events.intern, ["$old"])
        events.forget_all()  # a stored nid the cache does not know: that one is read

        def steps(txn):
            nids = events.intern(txn, ["$new1", "$new2"])
            statements = recording(txn)
            new = events.resolve(txn, [nids["$new1"], nids["$new2"]])
            asked_for_new = len(statements)
            others = events.resolve(txn, [nids["$new1"], stored["$old"], 10_000_000])
            return nids, new, asked_for_new, others, len(statements)

        nids, new, asked_for_new, others, total = await db.run_interaction("steps", steps)
        self.assertEqual(new, {nids["$new1"]: "$new1", nids["$new2"]: "$new2"})
        self.assertEqual(asked_for_new, 0)
        self.assertEqual(others, {nids["$new1"]: "$new1", stored["$old"]: "$old"})
        self.assertEqual(total, 1)  # one read, for $old and the nid that names nothing

    async def test_a_trial_run_takes_back_the_nids_it_resolved(self):
        db = await self.make_database()
        events = Interners().events

        def steps(txn):
            trial = txn.undone(lambda t: events.intern(t, ["$trial"]))
            return trial, events.resolve(txn, trial.values())

        trial, names = await db.run_interaction("steps", steps)
        self.assertEqual(len(trial), 1)
        self.assertEqual(names, {})  # rolled back: its nid names nothing

    async def test_the_only_writer_remembers_what_is_not_there(self):
        """SQLite (one writer): a key looked up and missing is inserted
        without asking again; PostgreSQL inserts straight away either way."""
        db = await self.make_database()
        events = Interners().events

        def steps(txn):
            statements = recording(txn)
            events.lookup(txn, ["$x"])
            events.intern(txn, ["$x"])
            return [s for s in statements if "FROM event_ids WHERE" in s]

        selects = await db.run_interaction("steps", steps)
        self.assertEqual(len(selects), 1)

    async def test_a_trial_run_takes_back_what_it_taught(self):
        db = await self.make_database()
        events = Interners().events

        def steps(txn):
            trial = txn.undone(lambda t: events.intern(t, ["$trial"]))
            seen_after = events.lookup(txn, ["$trial"])
            created: set = set()
            nids = events.intern(txn, ["$trial"], created)
            return trial, seen_after, created, nids

        trial, seen_after, created, nids = await db.run_interaction("steps", steps)
        self.assertEqual(set(trial), {"$trial"})
        self.assertEqual(seen_after, {})  # rolled back: not there, whatever the trial learned
        self.assertEqual(created, {"$trial"})
        count = await db.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM event_ids"))
        self.assertEqual(count, 1)
        self.assertEqual(await db.run_interaction("again", events.lookup, ["$trial"]), nids)

    async def test_reserve_ids_takes_several_tables_ids_in_one_statement(self):
        db = await self.make_database()

        def steps(txn):
            statements = recording(txn)
            txn.reserve_ids([("state_groups", "state_group", 3), ("visibility_snapshots", "snapshot_nid", 2)])
            reserved = len(statements)
            groups = [txn.next_id("state_groups", "state_group") for _ in range(3)]
            snapshots = [txn.next_id("visibility_snapshots", "snapshot_nid") for _ in range(2)]
            return reserved, len(statements), groups, snapshots

        reserved, total, groups, snapshots = await db.run_interaction("steps", steps)
        self.assertEqual(groups, sorted(set(groups)))
        self.assertEqual(snapshots, sorted(set(snapshots)))
        if db.engine.serial_ids_sql is not None:  # PostgreSQL: one statement, then none
            self.assertEqual((reserved, total), (1, 1))
        else:  # SQLite: nothing reserved ahead; next_id counts from the table
            self.assertEqual(reserved, 0)
        # Ids reserved and used in a committed transaction are never handed out again.
        more = await db.run_interaction("more", lambda t: t.next_id("state_groups", "state_group"))
        if db.engine.serial_ids_sql is not None:
            self.assertGreater(more, max(groups))
