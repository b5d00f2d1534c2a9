"""Interning: ids are stable, new keys are reported as created, on both engines."""

from __future__ import annotations

from roomstore.storage.interning import Interner, Interners
from tests.db import on_both_engines


@on_both_engines
class InternerTests:
    async def test_created_lists_only_keys_this_call_inserted(self):
        db = await self.make_database()
        events = Interners().events
        created: set = set()
        first = await db.run_interaction("intern", events.intern, ["$a", "$b"], created)
        self.assertEqual(created, {"$a", "$b"})
        self.assertEqual(len(set(first.values())), 2)

        # A fresh interner (cold cache, as after a restart) finds the stored
        # keys in the database and creates only the new one.
        again: set = set()
        second = await db.run_interaction("intern", Interners().events.intern, ["$b", "$c", "$a"], again)
        self.assertEqual(again, {"$c"})
        self.assertEqual((second["$a"], second["$b"]), (first["$a"], first["$b"]))
        self.assertNotIn(second["$c"], first.values())
        rows = await db.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM event_ids"))
        self.assertEqual(rows, 3)

    async def test_tuple_keys_round_trip(self):
        db = await self.make_database()
        keys = Interners().state_keys
        created: set = set()
        nids = await db.run_interaction(
            "intern", keys.intern, [("m.room.member", "@a:x"), ("m.room.topic", "")], created
        )
        self.assertEqual(created, {("m.room.member", "@a:x"), ("m.room.topic", "")})
        names = await db.run_interaction(
            "resolve", Interner("state_keys", "type_key_nid", ["type", "state_key"]).resolve, nids.values()
        )
        self.assertEqual({names[n]: n for n in names}, nids)

    async def test_rolled_back_intern_is_not_cached(self):
        """The cache learns nids only after commit: a rolled-back insert leaves nothing behind."""
        db = await self.make_database()
        events = Interners().events

        def intern_then_fail(txn):
            events.intern(txn, ["$gone"])
            raise ValueError("roll back")

        with self.assertRaises(ValueError):
            await db.run_interaction("fail", intern_then_fail)
        self.assertIsNone(events.cached_nid("$gone"))
        created: set = set()
        await db.run_interaction("intern", events.intern, ["$gone"], created)
        self.assertEqual(created, {"$gone"})

    async def test_resolve_list_keeps_order_and_duplicates(self):
        db = await self.make_database()
        keys = [("m.room.member", f"@u{i}:x") for i in range(12)]
        nids = await db.run_interaction("intern", Interners().state_keys.intern, keys)
        wanted = [nids[k] for k in reversed(keys)] + [nids[keys[0]]]
        # A cold interner reads them from the table; a warm one from its cache;
        # one with a cache of 4 (smaller than the request) still answers whole.
        for interner in (Interners().state_keys, Interners(cache_size=4).state_keys):
            for _ in range(2):
                got = await db.run_interaction("resolve", interner.resolve_list, wanted)
                self.assertEqual(got, list(reversed(keys)) + [keys[0]])
                self.assertLessEqual(len(interner._to_key), interner._to_key.max_size)
        missing = max(nids.values()) + 1000
        with self.assertRaises(KeyError):
            await db.run_interaction("resolve", Interners().state_keys.resolve_list, [wanted[0], missing])

    async def test_resolve_caches_only_after_commit(self):
        """A read in a transaction that rolls back teaches the cache nothing;
        one that commits does, and the next read needs no statement."""
        db = await self.make_database()
        nids = await db.run_interaction("intern", Interners().events.intern, ["$a", "$b"])
        events = Interners().events

        def resolve_then_fail(txn):
            self.assertEqual(events.resolve_list(txn, [nids["$a"]]), ["$a"])
            raise ValueError("roll back")

        with self.assertRaises(ValueError):
            await db.run_interaction("fail", resolve_then_fail)
        self.assertNotIn(nids["$a"], events._to_key)
        await db.run_interaction("resolve", events.resolve_list, [nids["$a"], nids["$b"]])
        self.assertIn(nids["$a"], events._to_key)

        def no_statements(txn):
            txn.execute = None  # any statement would fail
            return events.resolve_list(txn, [nids["$b"], nids["$a"]]), events.resolve(txn, [nids["$a"]])

        self.assertEqual(await db.run_interaction("cached", no_statements), (["$b", "$a"], {nids["$a"]: "$a"}))

    async def test_dense_nids_are_read_as_a_range_and_sparse_ones_by_key(self):
        """Nids filling at least half of their range (a stream page's) come
        from one range read, which answers only the nids asked for; sparse
        ones from lookups by key; both answer exactly, in order."""
        db = await self.make_database()
        ids = [f"$e{i}" for i in range(40)]
        nids = await db.run_interaction("intern", Interners().events.intern, ids)
        ordered = sorted(nids.values())
        by_nid = {nid: key for key, nid in nids.items()}
        statements: list[str] = []

        def resolve(txn, wanted):
            execute = txn.execute

            def recording(sql, *args, **kwargs):
                statements.append(sql)
                return execute(sql, *args, **kwargs)

            txn.execute = recording
            return Interners().events.resolve_list(txn, wanted)

        dense = ordered[5:35:2] + [ordered[20]]  # every other nid of a stretch, one twice
        self.assertEqual(await db.run_interaction("dense", resolve, dense), [by_nid[n] for n in dense])
        self.assertEqual(len(statements), 1)
        self.assertIn(">=", statements[0])
        statements.clear()
        sparse = ordered[::4]
        self.assertEqual(await db.run_interaction("sparse", resolve, sparse), [by_nid[n] for n in sparse])
        self.assertNotIn(">=", statements[0])

    async def test_resolve_list_without_remembering_leaves_the_cache_alone(self):
        db = await self.make_database()
        nids = await db.run_interaction("intern", Interners().events.intern, [f"$e{i}" for i in range(20)])
        events = Interners().events
        wanted = sorted(nids.values())
        got = await db.run_interaction("resolve", events.resolve_list, wanted, False)
        self.assertEqual(got, sorted(nids, key=nids.get))
        self.assertEqual(len(events._to_key), 0)
        await db.run_interaction("resolve", events.resolve_list, wanted)
        self.assertEqual(len(events._to_key), 20)
