"""RoomStore.sync: new events since a stream token, and the user's own memberships anywhere.

Rooms where the user joins, leaves, is kicked, banned and invited; the cost
rules (no statement when nothing changed, one statement for any number of
changed rooms); every token form, including the multi-writer one.
"""

from __future__ import annotations

import threading

from twisted.internet import defer, threads
from twisted.trial import unittest

from roomstore.events.tokens import InvalidToken, StreamToken
from roomstore.store import RoomStore, StoreConfig
from tests.db import DatabaseTestMixin, on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
CAROL = "@carol:example.org"


def ids(events):
    return [e["event_id"] for e in events]


class SyncHelpers:
    async def open_store(self, url: str | None = None, config: StoreConfig | None = None) -> RoomStore:
        db = await self.make_database(url)
        store = await RoomStore.open(db, config)
        self.addCleanup(store.close)
        return store

    async def persist(self, store, room, *events, **flags):
        return await store.persist_events([room.to_persist(e, **flags) for e in events])

    async def new_room(self, store, name: str, visibility: str = "shared") -> RoomBuilder:
        room = RoomBuilder(room_id=f"!{name}:example.org")
        await self.persist(
            store, room, room.create(), room.join(ALICE), room.join_rules(), room.history_visibility(visibility)
        )
        return room

    async def settle(self, store) -> int:
        """Let the stream generators write their positions (background
        statements of the persists), then return the query count."""
        for generator in store.generators.values():
            await generator.flush()
        return store.db.query_count

    def count_interactions(self, store) -> list[str]:
        """Names of the interactions run from now on (the database itself is real)."""
        calls: list[str] = []
        original = store.db.run_interaction

        async def counting(description, fn, *args, **kwargs):
            calls.append(description)
            return await original(description, fn, *args, **kwargs)

        store.db.run_interaction = counting
        self.addCleanup(setattr, store.db, "run_interaction", original)
        return calls


@on_both_engines
class SyncTests(SyncHelpers):
    async def test_joins_leaves_kicks_bans_invites_across_rooms(self):
        store = await self.open_store()
        kicked = await self.new_room(store, "kicked")  # Bob joins, then is kicked
        left = await self.new_room(store, "left", "world_readable")  # Bob joins, then leaves
        banned = await self.new_room(store, "banned")  # Bob joins, then is banned
        stays = await self.new_room(store, "stays", "joined")  # Bob joins and stays
        invited = await self.new_room(store, "invited", "joined")  # Bob is invited, never joins
        other = await self.new_room(store, "other")  # Bob never hears of it

        initial = await store.sync(BOB, None)
        self.assertEqual(initial.rooms, {})
        self.assertEqual(initial.membership_events, [])
        self.assertEqual(initial.next_token, store.get_current_token())
        token0 = initial.next_token

        # Window 1: joins, an invite, messages before and after the joins.
        before_join = stays.message(ALICE, "before bob joined (joined-only history)")
        await self.persist(store, stays, before_join)
        joins = {}
        for room in (kicked, left, banned, stays):
            joins[room.room_id] = room.join(BOB)
            await self.persist(store, room, joins[room.room_id])
        invite = invited.member(BOB, "invite", sender=ALICE)
        await self.persist(store, invited, invite)
        after_invite = invited.message(ALICE, "bob cannot see this")
        await self.persist(store, invited, after_invite)
        unrelated = other.message(ALICE, "nothing to do with bob")
        await self.persist(store, other, unrelated)
        msgs = {}
        for room in (kicked, left, banned, stays):
            msgs[room.room_id] = room.message(ALICE, f"hello bob in {room.room_id}")
            await self.persist(store, room, msgs[room.room_id])

        first = await store.sync(BOB, token0)
        self.assertEqual(set(first.rooms), {kicked.room_id, left.room_id, banned.room_id, stays.room_id})
        for room in (kicked, left, banned, stays):
            self.assertEqual(
                ids(first.rooms[room.room_id]), [joins[room.room_id].event_id, msgs[room.room_id].event_id]
            )
        # Joined-only history: the message before the join is not shown.
        self.assertNotIn(before_join.event_id, ids(first.rooms[stays.room_id]))
        # Own memberships anywhere, in stream order, the never-joined invite included.
        self.assertEqual(
            ids(first.membership_events),
            [
                joins[kicked.room_id].event_id,
                joins[left.room_id].event_id,
                joins[banned.room_id].event_id,
                joins[stays.room_id].event_id,
                invite.event_id,
            ],
        )
        self.assertEqual(list(first.invited), [invited.room_id])
        self.assertEqual(first.invited[invited.room_id]["event_id"], invite.event_id)
        self.assertEqual(first.left, {})
        self.assertEqual(first.joined, frozenset({kicked.room_id, left.room_id, banned.room_id, stays.room_id}))
        self.assertEqual(first.next_token, store.get_current_token())

        # Window 2: a kick, a leave, a ban, each with messages before and after.
        last = {}
        for room, membership, sender in ((kicked, "leave", ALICE), (left, "leave", BOB), (banned, "ban", ALICE)):
            before = room.message(ALICE, "still here")
            membership_event = room.member(BOB, membership, sender=sender)
            after = room.message(ALICE, "gone now")
            await self.persist(store, room, before, membership_event, after)
            last[room.room_id] = (before, membership_event, after)
        stays_msg = stays.message(ALICE, "you stayed")
        await self.persist(store, stays, stays_msg)

        second = await store.sync(BOB, first.next_token)
        for room_id, (before, membership_event, _after) in last.items():
            # Up to and including the membership change; never after it, not
            # even in the world-readable room.
            self.assertEqual(ids(second.rooms[room_id]), [before.event_id, membership_event.event_id])
        self.assertEqual(ids(second.rooms[stays.room_id]), [stays_msg.event_id])
        self.assertEqual(
            ids(second.membership_events), [last[r][1].event_id for r in (kicked.room_id, left.room_id, banned.room_id)]
        )
        self.assertEqual(set(second.left), {kicked.room_id, left.room_id, banned.room_id})
        self.assertEqual(second.left[banned.room_id]["content"]["membership"], "ban")
        self.assertEqual(second.joined, frozenset({stays.room_id}))

        # Nothing since: nothing, and the token stays.
        third = await store.sync(BOB, second.next_token)
        self.assertEqual((third.rooms, third.membership_events), ({}, []))
        self.assertEqual(third.next_token, second.next_token)

        # A sync over both windows at once gives the union, in stream order.
        both = await store.sync(BOB, token0)
        self.assertEqual(ids(both.membership_events), ids(first.membership_events) + ids(second.membership_events))
        self.assertEqual(
            ids(both.rooms[kicked.room_id]),
            ids(first.rooms[kicked.room_id]) + ids(second.rooms[kicked.room_id]),
        )

    async def test_no_query_when_nothing_changed_and_one_statement_for_many_rooms(self):
        store = await self.open_store()
        rooms = [await self.new_room(store, f"r{i}") for i in range(5)]
        for room in rooms:
            await self.persist(store, room, room.join(BOB))
        quiet = await self.new_room(store, "quiet")  # Bob is not in it; changes there cost nothing
        # Warm what a long-running server has cached: rooms-for-user, the
        # interned nids (persisting interned Bob and his member key).
        await store.get_rooms_for_user(BOB)
        token = (await store.sync(BOB, None)).next_token
        self.assertIsNotNone(store.interners.users.cached_nid(BOB))
        self.assertIsNotNone(store.interners.state_keys.cached_nid(("m.room.member", BOB)))

        calls = self.count_interactions(store)
        await self.persist(store, quiet, quiet.message(ALICE, "elsewhere"))
        queries, calls[:] = await self.settle(store), []
        result = await store.sync(BOB, token)
        self.assertEqual(store.db.query_count - queries, 0)
        self.assertEqual(calls, [])
        self.assertEqual((result.rooms, result.membership_events), ({}, []))
        self.assertEqual(result.next_token, store.get_current_token())

        # Three of Bob's rooms change: one interaction, one statement.
        sent = {}
        for room in rooms[:3]:
            sent[room.room_id] = [room.message(ALICE, "a"), room.message(BOB, "b")]
            await self.persist(store, room, *sent[room.room_id])
        queries, calls[:] = await self.settle(store), []
        result = await store.sync(BOB, token)
        self.assertEqual(store.db.query_count - queries, 1)
        self.assertEqual(calls, ["sync"])
        self.assertEqual(
            {r: ids(evs) for r, evs in result.rooms.items()}, {r: [e.event_id for e in evs] for r, evs in sent.items()}
        )

        # Still one statement when Bob's own membership changed too (a
        # room left) on top of the changed rooms.
        leave = rooms[4].member(BOB, "leave")
        await self.persist(store, rooms[4], leave)
        await store.get_rooms_for_user(BOB)  # the membership change dropped it; warm again
        queries, calls[:] = await self.settle(store), []
        result = await store.sync(BOB, token)
        self.assertEqual(store.db.query_count - queries, 1)
        self.assertEqual(calls, ["sync"])
        self.assertEqual(ids(result.membership_events), [leave.event_id])
        self.assertEqual(set(result.rooms), set(sent) | {rooms[4].room_id})

        # A room joined in the window comes with its state: one transaction more.
        fresh = await self.new_room(store, "fresh")
        join = fresh.join(BOB)
        await self.persist(store, fresh, join)
        await store.get_rooms_for_user(BOB)
        queries, calls[:] = await self.settle(store), []
        result = await store.sync(BOB, token)
        self.assertEqual(calls, ["sync", "sync_state"])
        self.assertEqual(ids(result.membership_events), [leave.event_id, join.event_id])
        self.assertEqual(set(result.rooms), set(sent) | {fresh.room_id, rooms[4].room_id})
        # The room is younger than the token: its whole state is in the timeline, none in the block.
        self.assertEqual(len(result.timelines[fresh.room_id].events), 5)
        self.assertEqual(result.timelines[fresh.room_id].state, [])

    async def test_change_cache_that_cannot_tell_still_one_statement(self):
        store = await self.open_store(config=StoreConfig(change_cache_size=1))
        rooms = [await self.new_room(store, f"r{i}") for i in range(3)]
        for room in rooms:
            await self.persist(store, room, room.join(BOB))
        token = store.get_current_token()
        for room in rooms:
            await self.persist(store, room, room.message(ALICE, "x"))
        # A cache of one entry has forgotten the earlier changes.
        self.assertFalse(store.room_changes.knows_since(StreamToken.parse(token).stream))
        await store.get_rooms_for_user(BOB)
        queries = await self.settle(store)
        result = await store.sync(BOB, token)
        self.assertEqual(store.db.query_count - queries, 1)
        self.assertEqual(set(result.rooms), {r.room_id for r in rooms})

    async def test_outliers_and_rejected_events(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")
        await self.persist(store, room, room.join(BOB))
        token = store.get_current_token()
        rejected = room.message(ALICE, "rejected")
        await self.persist(store, room, rejected, rejected_reason="auth_error")
        # An invite from a room this server is not in arrives as an outlier:
        # not a timeline event, but Bob must still get it.
        remote = RoomBuilder(room_id="!remote:elsewhere.org", creator="@zed:elsewhere.org")
        remote.create()
        remote_invite = remote.member(BOB, "invite", sender="@zed:elsewhere.org")
        await self.persist(store, remote, remote_invite, outlier=True)
        ok = room.message(ALICE, "fine")
        await self.persist(store, room, ok)
        result = await store.sync(BOB, token)
        self.assertEqual({r: ids(e) for r, e in result.rooms.items()}, {room.room_id: [ok.event_id]})
        self.assertEqual(ids(result.membership_events), [remote_invite.event_id])
        self.assertEqual(list(result.invited), [remote.room_id])

    async def test_redacted_events_come_pruned(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")
        await self.persist(store, room, room.join(BOB))
        token = store.get_current_token()
        msg = room.message(ALICE, "secret")
        redaction = room.redact(ALICE, msg.event_id)
        await self.persist(store, room, msg, redaction)
        result = await store.sync(BOB, token)
        [served, served_redaction] = result.rooms[room.room_id]
        self.assertEqual(served, await store.get_event(msg.event_id))
        self.assertEqual(served["content"], {})
        self.assertEqual(served["unsigned"]["redacted_because"]["event_id"], redaction.event_id)
        self.assertEqual(served_redaction["event_id"], redaction.event_id)

    async def test_sync_woken_by_the_position_sees_the_batch(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")
        await self.persist(store, room, room.join(BOB))
        await store.get_rooms_for_user(BOB)
        token = store.get_current_token()
        woken = {}

        async def wake_on_position():
            # A reader waiting for the position resumes as soon as it moves.
            await store.events_stream.wait_for_position(StreamToken.parse(token).stream + 1)
            woken["result"] = await store.sync(BOB, token)

        waiter = defer.ensureDeferred(wake_on_position())
        msg = room.message(ALICE, "hello")
        await self.persist(store, room, msg)
        await waiter
        self.assertEqual(ids(woken["result"].rooms.get(room.room_id, [])), [msg.event_id])

    async def test_tokens(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")  # stream 1..4
        await self.persist(store, room, room.join(BOB))  # 5
        m6, m7 = room.message(ALICE, "6"), room.message(ALICE, "7")
        await self.persist(store, room, m6, m7)
        for bad in ("", "x1", "s", "s01", "s-1", "t1-1", "m2", "m2~1.1", 5):
            with self.assertRaises(InvalidToken, msg=repr(bad)):
                await store.sync(BOB, bad)
        instance_id = await store.db.run_interaction(
            "id", lambda t: t.select_one_value("SELECT instance_id FROM instances WHERE instance_name = ?", ("master",))
        )
        # The multi-writer form: this writer (by its instance id) at 6, any
        # other writer at 2: only this writer's events after 6 are new.
        result = await store.sync(BOB, f"m2~{instance_id}.6")
        self.assertEqual(ids(result.rooms[room.room_id]), [m7.event_id])
        self.assertEqual(result.next_token, "s7")
        with self.assertRaises(InvalidToken):
            await store.sync(BOB, f"m2~{instance_id + 100}.5")  # no such instance
        # A token ahead of the writer's own stream was never issued: a client
        # holding it would miss every event up to it (tests/store/test_token_ahead.py).
        with self.assertRaises(InvalidToken):
            await store.sync(BOB, "s9")


class MultiWriterSyncTests(SyncHelpers, DatabaseTestMixin, unittest.TestCase):
    """Two writers of the events stream: tokens name each writer's position.

    PostgreSQL only, as multi-writer streams are (SQLite refuses them: see
    tests/store/test_multi_writer.py); the ``m`` token form itself is tested
    on both engines above.
    """

    engine_name = "postgres"

    async def test_each_writers_events_exactly_once(self):
        url = self.new_database_url()
        writers = {"events": ["w1", "w2"], "backfill": ["w1", "w2"], "caches": ["w1", "w2"]}
        w1 = await self.open_store(url, StoreConfig(instance_name="w1", stream_writers=writers))
        w2 = await self.open_store(url, StoreConfig(instance_name="w2", stream_writers=writers))
        r1 = RoomBuilder(room_id="!r1:example.org")
        r2 = RoomBuilder(room_id="!r2:example.org")
        await self.persist(w1, r1, r1.create(), r1.join(ALICE), r1.join_rules(), r1.join(BOB))
        await self.persist(w2, r2, r2.create(), r2.join(ALICE), r2.join_rules(), r2.join(BOB))

        def replicate(results=()):
            # What replication does on w1 for w2's rows: change caches, then
            # the position.
            for r in results:
                w1.room_changes.entity_has_changed(r.room_id, r.stream_ordering)
            w1.events_stream.advance("w2", w2.events_stream.get_current_token_for_writer("w2"))

        replicate()
        token = (await w1.sync(BOB, None)).next_token
        seen: list[str] = []
        sent: list[str] = []
        for step in range(4):
            a = [r1.message(ALICE, f"w1 {step} {i}") for i in range(2)]
            b = [r2.message(ALICE, f"w2 {step} {i}") for i in range(3)]
            await self.persist(w1, r1, *a)
            res_b = await self.persist(w2, r2, *b)
            sent += [e.event_id for e in a + b]
            if step % 2 == 0:
                # w1 has not heard of w2's new events: the token says how far
                # each writer is known, so they come next time.
                result = await w1.sync(BOB, token)
                self.assertEqual(set(result.rooms), {r1.room_id})
                parsed = StreamToken.parse(result.next_token)
                self.assertTrue(result.next_token.startswith("m"), result.next_token)
                self.assertLess(parsed.stream, parsed.get_max_stream_pos())
                seen += [e["event_id"] for evs in result.rooms.values() for e in evs]
                token = result.next_token
            replicate(res_b)
            result = await w1.sync(BOB, token)
            seen += [e["event_id"] for evs in result.rooms.values() for e in evs]
            token = result.next_token
        self.assertEqual(sorted(seen), sorted(sent))
        self.assertEqual(len(seen), len(set(seen)))


class ReadCacheRaceTests(SyncHelpers, DatabaseTestMixin, unittest.TestCase):
    """A read in flight while a change commits must not cache its old answer.

    PostgreSQL only: it takes two connections for a read to overlap a
    write; SQLite's one connection runs them one after the other.
    """

    engine_name = "postgres"

    def hold_after_query(self, obj, name):
        """Make ``obj.name`` (a transaction function) pause after its query
        until released; returns (entered, release) events."""
        entered, release = threading.Event(), threading.Event()
        original = getattr(obj, name)

        def held(*args, **kwargs):
            result = original(*args, **kwargs)
            entered.set()
            release.wait(10)
            return result

        setattr(obj, name, held)
        self.addCleanup(setattr, obj, name, original)
        return entered, release

    async def test_rooms_for_user_read_during_a_join(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")
        token = store.get_current_token()
        entered, release = self.hold_after_query(store.reader, "rooms_for_user_txn")
        in_flight = defer.ensureDeferred(store.get_rooms_for_user(BOB))
        await threads.deferToThread(entered.wait, 10)
        join = room.join(BOB)
        await self.persist(store, room, join)
        release.set()
        self.assertEqual(await in_flight, frozenset())  # its snapshot predates the join
        self.assertEqual(await store.get_rooms_for_user(BOB), frozenset({room.room_id}))
        result = await store.sync(BOB, token)
        self.assertEqual(ids(result.rooms[room.room_id]), [join.event_id])

    async def test_event_read_during_its_redaction(self):
        store = await self.open_store()
        room = await self.new_room(store, "r")
        msg = room.message(ALICE, "oops")
        await self.persist(store, room, msg)
        entered, release = self.hold_after_query(store.reader, "events_txn")
        in_flight = defer.ensureDeferred(store.get_event(msg.event_id))
        await threads.deferToThread(entered.wait, 10)
        await self.persist(store, room, room.redact(ALICE, msg.event_id))
        release.set()
        self.assertEqual((await in_flight)["content"]["body"], "oops")
        self.assertEqual((await store.get_event(msg.event_id))["content"], {})
