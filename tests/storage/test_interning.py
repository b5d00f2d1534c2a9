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
        names = await db.run_interaction("resolve", Interner("state_keys", "type_key_nid", ["type", "state_key"]).resolve, nids.values())
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
