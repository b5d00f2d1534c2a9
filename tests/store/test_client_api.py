"""What a client-server front needs of the store (issue 41 item 2): the
topological token of an event, and events in the client format."""

from __future__ import annotations

from twisted.trial import unittest

from roomstore.events.read.client_format import client_event
from roomstore.storage import NotFoundError
from roomstore.store import ClientTxn, RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def ids(events):
    return [e["event_id"] for e in events]


class RoomHelpers:
    async def open_room_store(self) -> RoomStore:
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        return store

    async def build_forked_room(self, store):
        """A room whose topological order is not its stream order (two
        branches persisted interleaved, a late event on an old branch), and
        an outlier. Returns (room, results by event ID of the graph events,
        the outlier's ID)."""
        room = RoomBuilder(room_id="!client:example.org")
        results = {}

        async def persist(*events, **flags):
            for result in await store.persist_events([room.to_persist(e, **flags) for e in events]):
                results[result.event_id] = result

        await persist(room.create(), room.join(ALICE), room.join_rules(), room.join(BOB))
        base = room.message(ALICE, "base")
        await persist(base)
        a1 = room.message(ALICE, "a1", prev=[base.event_id])
        b1 = room.message(BOB, "b1", prev=[base.event_id])
        a2 = room.message(ALICE, "a2", prev=[a1.event_id])
        await persist(a1, b1)
        await persist(a2)
        room.leaves = [a2.event_id, b1.event_id]
        await persist(room.message(ALICE, "merge"))
        leaves = list(room.leaves)
        late = room.message(BOB, "late", prev=[a1.event_id])
        room.leaves = leaves
        await persist(late)
        await persist(room.message(ALICE, "last"))
        outlier = room.message(ALICE, "outlier", prev=[fake_event_id("gone")], set_leaves=False)
        await persist(outlier, outlier=True)
        del results[outlier.event_id]
        return room, results, outlier.event_id


@on_both_engines
class TopologicalTokenTests(RoomHelpers):
    async def test_token_of_every_event_and_pages_from_it(self):
        store = await self.open_room_store()
        room, results, _ = await self.build_forked_room(store)
        keys = {e: (r.topological_ordering, r.stream_ordering) for e, r in results.items()}
        ascending = sorted(keys, key=keys.__getitem__)
        self.assertNotEqual(ascending, sorted(keys, key=lambda e: keys[e][1]))  # the forks matter
        for position, event_id in enumerate(ascending):
            token = await store.get_topological_token(event_id)
            self.assertEqual(token, results[event_id].topological_token)
            self.assertEqual(token, "t{}-{}".format(*keys[event_id]))
            # The token is the position just after the event: backwards from
            # it comes the event, then each one before it in topological
            # order; forwards, the events after it.
            back = await store.paginate(room.room_id, ALICE, token, "b", len(keys))
            self.assertEqual(ids(back.events), ascending[position::-1])
            forward = await store.paginate(room.room_id, ALICE, token, "f", len(keys))
            self.assertEqual(ids(forward.events), ascending[position + 1 :])
            # One page of one event ends just before it: the next page starts right before the event.
            first = await store.paginate(room.room_id, ALICE, token, "b", 1)
            self.assertEqual(ids(first.events), [event_id])
            before = await store.paginate(room.room_id, ALICE, first.next_token, "b", 1)
            self.assertEqual(ids(before.events), ascending[position - 1 : position] if position else [])

    async def test_unknown_event_and_outlier_raise_not_found(self):
        store = await self.open_room_store()
        _, _, outlier = await self.build_forked_room(store)
        unknown = fake_event_id("nobody has it")
        with self.assertRaises(NotFoundError) as caught:
            await store.get_topological_token(unknown)
        self.assertEqual(str(caught.exception), f"event {unknown} is not stored")
        self.assertIsInstance(caught.exception, KeyError)
        with self.assertRaises(NotFoundError) as caught:
            await store.get_topological_token(outlier)
        self.assertIn("is an outlier", str(caught.exception))


FEDERATION_ONLY = ("auth_events", "prev_events", "hashes", "signatures", "depth", "origin")


@on_both_engines
class ClientFormatTests(RoomHelpers):
    async def test_messages_state_and_redactions(self):
        store = await self.open_room_store()
        room = RoomBuilder(room_id="!format:example.org")
        create, join = room.create(), room.join(ALICE)
        topic1 = room.state("m.room.topic", "", {"topic": "one"})
        topic2 = room.state("m.room.topic", "", {"topic": "two"})
        message = room.message(ALICE, "hello")
        secret_topic = room.state("m.room.topic", "", {"topic": "secret"})
        redaction = room.redact(ALICE, secret_topic.event_id)
        invite = room.member(
            BOB,
            "invite",
            sender=ALICE,
            extra={
                "unsigned": {
                    "invite_room_state": [
                        {"type": "m.room.name", "state_key": "", "content": {"name": "n"}, "sender": ALICE}
                    ],
                    "age_ts": 5,
                    "prev_content": {"forged": True},
                    "other": 1,
                }
            },
        )
        built = [create, join, topic1, topic2, message, secret_topic, redaction, invite]
        results = await store.persist_events([room.to_persist(e) for e in built])
        self.assertEqual([r.rejected_reason for r in results], [None] * len(built))
        served = await store.get_events([e.event_id for e in built])
        cached = {e: dict(served[e]) for e in served}
        now = 10**13
        formatted = await store.format_client_events([served[e.event_id] for e in built], now)
        by_id = {e["event_id"]: e for e in formatted}
        self.assertEqual([e["event_id"] for e in formatted], [e.event_id for e in built])
        for event in formatted:
            for key in FEDERATION_ONLY:
                self.assertNotIn(key, event)
            self.assertEqual(event["unsigned"]["age"], now - event["origin_server_ts"])
        # A message: the ClientEvent keys and an age.
        self.assertEqual(
            by_id[message.event_id],
            {
                "event_id": message.event_id,
                "type": "m.room.message",
                "content": message.event["content"],
                "sender": ALICE,
                "origin_server_ts": message.event["origin_server_ts"],
                "room_id": room.room_id,
                "unsigned": {"age": now - message.event["origin_server_ts"]},
            },
        )
        # State: the first of a key replaces nothing; the next replaces it.
        self.assertEqual(by_id[create.event_id]["state_key"], "")
        self.assertNotIn("prev_content", by_id[create.event_id]["unsigned"])
        self.assertNotIn("replaces_state", by_id[topic1.event_id]["unsigned"])
        self.assertEqual(by_id[topic2.event_id]["unsigned"]["prev_content"], {"topic": "one"})
        self.assertEqual(by_id[topic2.event_id]["unsigned"]["replaces_state"], topic1.event_id)
        # Redacted: pruned content, the redaction in the client format, what it replaced but not its content.
        redacted = by_id[secret_topic.event_id]
        self.assertEqual(redacted["content"], {})
        because = redacted["unsigned"]["redacted_because"]
        self.assertEqual(because["event_id"], redaction.event_id)
        self.assertEqual(because["unsigned"], {"age": now - redaction.event["origin_server_ts"]})
        for key in FEDERATION_ONLY:
            self.assertNotIn(key, because)
        self.assertEqual(redacted["unsigned"]["replaces_state"], topic2.event_id)
        self.assertNotIn("prev_content", redacted["unsigned"])
        # Of the PDU's unsigned only the invite's stripped state goes on; prev_content is the store's.
        invited = by_id[invite.event_id]["unsigned"]
        self.assertEqual(set(invited), {"age", "invite_room_state"})
        # The served events (the cache's own) are as they were.
        self.assertEqual(await store.get_events(list(served)), cached)
        self.assertEqual(served, cached)

    async def test_state_before_each_event_on_forks(self):
        store = await self.open_room_store()
        room = RoomBuilder(room_id="!forks:example.org")
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        base = room.state("m.room.topic", "", {"topic": "base"})
        await store.persist_events([room.to_persist(base)])
        left = room.state("m.room.topic", "", {"topic": "left"}, prev=[base.event_id])
        right = room.state("m.room.topic", "", {"topic": "right"}, prev=[base.event_id])
        after_left = room.state("m.room.topic", "", {"topic": "after left"}, prev=[left.event_id])
        results = await store.persist_events([room.to_persist(e) for e in (left, right, after_left)])
        self.assertEqual([r.rejected_reason for r in results], [None] * 3)
        page = await store.paginate(room.room_id, ALICE, None, "b", 10)
        formatted = {e["event_id"]: e for e in await store.format_client_events(page.events, 0)}
        replaced = {e: formatted[e]["unsigned"].get("replaces_state") for e in formatted}
        self.assertEqual(replaced[left.event_id], base.event_id)
        self.assertEqual(replaced[right.event_id], base.event_id)  # not left, stored before it
        self.assertEqual(replaced[after_left.event_id], left.event_id)
        self.assertEqual(formatted[after_left.event_id]["unsigned"]["prev_content"], {"topic": "left"})

    async def test_replaced_state_kept_until_a_purge(self):
        """What a stored state event replaced is read once: the next format
        of it runs no transaction, with the same answer; a purge drops it."""
        store = await self.open_room_store()
        room = RoomBuilder(room_id="!kept:example.org")
        create, join = room.create(), room.join(ALICE)
        topic1 = room.state("m.room.topic", "", {"topic": "one"})
        topic2 = room.state("m.room.topic", "", {"topic": "two"})
        sent = room.message(ALICE, "sent")
        built = [create, join, topic1, topic2, sent]
        results = await store.persist_events(
            [room.to_persist(e) for e in built[:-1]] + [room.to_persist(sent, client_txn=ClientTxn(ALICE, "D", "t1"))]
        )
        self.assertEqual([r.rejected_reason for r in results], [None] * len(built))
        served = [await store.get_event(e.event_id) for e in built]
        first = await store.format_client_events(served, 0, sent_by=(ALICE, "D"))
        self.assertEqual(first[3]["unsigned"]["replaces_state"], topic1.event_id)
        self.assertEqual(first[3]["unsigned"]["prev_content"], {"topic": "one"})
        self.assertEqual(first[4]["unsigned"]["transaction_id"], "t1")
        known, unknown = store.reader.cached_replaced(e.event_id for e in built[:-1])
        self.assertEqual(unknown, [])
        self.assertEqual(known[topic2.event_id], topic1.event_id)
        self.assertIsNone(known[topic1.event_id])
        # An event not stored is not answered for: it may be stored later, with a transaction.
        unstored = room.message(ALICE, "later")
        await store.format_client_events([dict(unstored.event, event_id=unstored.event_id)], 0, sent_by=(ALICE, "D"))
        self.assertEqual(store.reader.cached_txn_records([unstored.event_id]), ({}, [unstored.event_id]))
        served.append(await store.get_event(sent.event_id))
        first.append(first[4])
        transactions = []
        run_interaction = store.db.run_interaction

        async def counted(description, *args, **kwargs):
            transactions.append(description)
            return await run_interaction(description, *args, **kwargs)

        store.db.run_interaction = counted
        try:
            self.assertEqual(await store.format_client_events(served, 0, sent_by=(ALICE, "D")), first)
        finally:
            del store.db.run_interaction
        self.assertNotIn("client_format_lookups", transactions)
        await store.purge_room(room.room_id)
        self.assertEqual(store.reader.cached_replaced([topic2.event_id]), ({}, [topic2.event_id]))
        self.assertEqual(store.reader.cached_txn_records([sent.event_id]), ({}, [sent.event_id]))

    async def test_outliers_and_events_not_stored(self):
        store = await self.open_room_store()
        room = RoomBuilder(room_id="!outliers:example.org")
        create = room.create()
        join = room.join(ALICE)
        await store.persist_events([room.to_persist(e) for e in (create, join)])
        # An outlier has no state before it: nothing to say it replaced.
        outlier = room.state("m.room.topic", "", {"topic": "far"}, prev=[join.event_id], set_leaves=False)
        [result] = await store.persist_events([room.to_persist(outlier, outlier=True)])
        self.assertIsNone(result.rejected_reason)
        unstored = room.state("m.room.name", "", {"name": "never"})
        served = await store.get_event(outlier.event_id)
        formatted = await store.format_client_events([served, dict(unstored.event, event_id=unstored.event_id)], 0)
        for event in formatted:
            self.assertEqual(set(event["unsigned"]), {"age"})
        self.assertEqual(await store.format_client_events([], 0), [])

    async def test_age_from_the_store_clock(self):
        from twisted.internet.task import Clock

        clock = Clock()
        clock.advance(2_000_000)
        store = await RoomStore.open(await self.make_database(), clock=clock)
        self.addCleanup(store.close)
        room = RoomBuilder(room_id="!clock:example.org")
        create = room.create()
        await store.persist_events([room.to_persist(create)])
        [event] = await store.format_client_events([await store.get_event(create.event_id)])
        self.assertEqual(event["unsigned"]["age"], 2_000_000_000 - create.event["origin_server_ts"])


class ClientEventTests(unittest.TestCase):
    """The pure step, ``client_event``."""

    def test_a_room_version_1_state_event(self):
        pdu = {
            "event_id": "$2:example.org",
            "type": "m.room.member",
            "state_key": "@b:example.org",
            "content": {"membership": "join", "nested": {"a": [1]}},
            "sender": "@b:example.org",
            "origin_server_ts": 1000,
            "room_id": "!r:example.org",
            "prev_state": [],
            "depth": 3,
            "auth_events": [],
            "prev_events": [],
            "hashes": {},
            "signatures": {},
            "origin": "example.org",
            "membership": "join",
            "unsigned": {"age_ts": 999, "replaces_state": "$forged:example.org"},
        }
        before = {"event_id": "$1:example.org", "content": {"membership": "invite"}, "type": "m.room.member"}
        event = client_event(pdu, 1500, replaced_event=before)
        self.assertEqual(
            event,
            {
                "event_id": "$2:example.org",
                "type": "m.room.member",
                "state_key": "@b:example.org",
                "content": {"membership": "join", "nested": {"a": [1]}},
                "sender": "@b:example.org",
                "origin_server_ts": 1000,
                "room_id": "!r:example.org",
                "membership": "join",
                "unsigned": {"age": 500, "replaces_state": "$1:example.org", "prev_content": {"membership": "invite"}},
            },
        )
        event["content"]["nested"]["a"].append(2)
        event["unsigned"]["prev_content"]["membership"] = "ban"
        self.assertEqual(pdu["content"]["nested"], {"a": [1]})
        self.assertEqual(before["content"], {"membership": "invite"})
        # A message replaces no state, whatever it is given.
        message = dict(pdu, type="m.room.message")
        del message["state_key"]
        self.assertEqual(client_event(message, 1000, replaced_event=before)["unsigned"], {"age": 0})
