"""The database-backed streams and the worker handler, on SQLite and PostgreSQL.

Server side: ``get_updates`` of ``events``, ``backfill`` and ``caches`` over a
real store, checked against the ``Stream`` contract (token order, bounded
pages that never split a token, exact ``limited``/``upto_token``) and against
what was persisted. Worker side: a worker store fed through a real client
protocol sees what the writer persisted (positions, change caches, caches).
"""

from __future__ import annotations

import threading
from itertools import pairwise

from twisted.internet import defer, reactor, threads
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from roomstore.events.caches import CURRENT_STATE_CACHE, EVENT_CACHE, ROOMS_FOR_USER_CACHE
from roomstore.replication import ReplicationClientFactory, ReplicationConfig, ReplicationServerFactory
from roomstore.replication.store_handler import StoreReplicationHandler
from roomstore.replication.store_streams import (
    STORE_STREAMS,
    BackfillStream,
    CachesStream,
    EventsStream,
    store_stream_registry,
    wire_server,
)
from tests.db import on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import RoomBuilder, UncheckedRoomBuilder, fake_event_id, skip_precheck

from .store_utils import ALICE, BOB, CAROL, open_pair, rdata_lines, wait_until, with_timeout
from .utils import feed

BIG = 10**9


async def populate(store) -> dict:
    """A history with every kind of row: a room whose first batch changes
    several state keys at one token, one-event batches, a redaction, a leave,
    backfilled events, and direct cache invalidations."""
    room = UncheckedRoomBuilder("!a:example.org")
    first = [
        room.create(),
        room.join(ALICE),
        room.state("m.room.power_levels", "", {"users": {ALICE: 100}}),
        room.join(BOB),
    ]
    first_results = await store.persist_events([room.to_persist(e) for e in first])
    message = room.message(ALICE, "hello")
    await store.persist_events([room.to_persist(message)])
    redaction = room.redact(ALICE, message.event_id)
    await store.persist_events([room.to_persist(redaction)])
    other = UncheckedRoomBuilder("!b:example.org", creator=BOB)
    for event in (other.create(), other.join(BOB), other.message(BOB, "one"), other.message(BOB, "two")):
        await store.persist_events([other.to_persist(event)])
    leave = room.member(BOB, "leave")
    await store.persist_events([room.to_persist(leave)])
    old = UncheckedRoomBuilder("!old:example.org", creator=CAROL)
    old_events = [old.create(), old.join(CAROL), old.message(CAROL, "ancient"), old.message(CAROL, "older")]
    backfilled = await store.persist_events([old.to_persist(e, backfilled=True) for e in old_events])
    await store.invalidate_cache("custom_cache", None)
    await store.invalidate_cache("custom_cache", ["k1", "k2"])
    return {
        "room": room,
        "other": other,
        "message": message,
        "redaction": redaction,
        "leave": leave,
        "first_results": first_results,
        "backfilled": backfilled,
        "old_events": old_events,
    }


class ContractMixin:
    async def assert_contract(self, stream, from_token: int, upto: int, limit: int) -> list:
        """Page through ``(from_token, upto]`` with ``limit`` and check every
        promise of ``Stream.get_updates``; returns the pages."""
        everything = await stream.get_updates("master", from_token, upto, BIG)
        self.assertEqual((everything.upto_token, everything.limited), (upto, False))
        pages = []
        cursor = from_token
        while True:
            updates, page_upto, limited = await stream.get_updates("master", cursor, upto, limit)
            context = f"{stream.name} ({cursor}, {upto}] limit {limit}: {updates!r}"
            tokens = [t for t, _ in updates]
            self.assertEqual(tokens, sorted(tokens), context)
            self.assertTrue(all(cursor < t <= page_upto for t in tokens), context)
            if len(updates) > limit:
                # Only one token may overflow a page, and only alone.
                self.assertEqual(len(set(tokens)), 1, context)
            if limited:
                self.assertTrue(updates, context)
                self.assertEqual(page_upto, tokens[-1], context)
            else:
                self.assertEqual(page_upto, upto, context)
            pages.append((updates, page_upto, limited))
            if not limited:
                break
            cursor = page_upto
        joined = [u for page, _, _ in pages for u in page]
        self.assertEqual(joined, list(everything.updates), f"{stream.name} limit {limit}")
        # No token split across pages, every page but the last full (its next
        # token would not have fit), and `limited` exactly when rows remained.
        for (page, _, limited), (after, _, _) in pairwise(pages):
            self.assertTrue(limited)
            self.assertTrue(after, f"{stream.name}: limited page followed by nothing")
            self.assertLess(page[-1][0], after[0][0])
            next_token_rows = sum(1 for t, _ in after if t == after[0][0])
            self.assertGreater(len(page) + next_token_rows, limit, f"{stream.name}: page cut early")
        return pages


def rows_by_token(updates: list[tuple[int, object]]) -> list[tuple[int, list]]:
    """A page's ``(token, row)`` updates as ``(token, rows)``, one per token, in order."""
    grouped: list[tuple[int, list]] = []
    for token, row in updates:
        if grouped and grouped[-1][0] == token:
            grouped[-1][1].append(row)
        else:
            grouped.append((token, [row]))
    return grouped


async def whole_pages(writer) -> dict[str, list]:
    """Every store stream's updates from the start, one page each."""
    return {
        stream.name: (await stream.get_updates("master", 0, stream.current_token("master"), BIG)).updates
        for stream in store_stream_registry(writer)
    }


def assert_workers_agree(case, fed, by_token, writer, pages) -> None:
    """``fed`` ends where ``by_token`` (fed token by token) and the writer
    are: every stream's position, and the room and membership change caches
    at every token of ``pages``' events."""
    for name in STORE_STREAMS:
        case.assertEqual(fed.stream(name).get_current_token(), by_token.stream(name).get_current_token())
        case.assertEqual(fed.stream(name).get_current_token(), writer.stream(name).get_current_token())
    rooms = {r[1][1] for _, r in pages["events"] if r[0] == "ev"}
    users = {r[1][3] for _, r in pages["events"] if r[0] == "ev" and r[1][2] == "m.room.member"}
    for since in range(0, writer.stream("events").get_current_token() + 1):
        case.assertEqual(
            fed.room_changes.get_entities_changed(rooms, since),
            by_token.room_changes.get_entities_changed(rooms, since),
            since,
        )
        case.assertEqual(
            fed.membership_changes.get_entities_changed(users, since),
            by_token.membership_changes.get_entities_changed(users, since),
            since,
        )


@on_both_engines
class StoreStreamTests(ContractMixin):
    async def test_events_rows_match_what_was_persisted(self):
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        stream = EventsStream(writer)
        self.assertEqual(stream.writers(), ["master"])
        current = stream.current_token("master")
        self.assertEqual(current, writer.events_stream.get_current_token())
        updates, upto, limited = await stream.get_updates("master", 0, current, BIG)
        self.assertEqual((upto, limited), (current, False))
        events = [(t, row) for t, row in updates if row[0] == "ev"]
        # One ev row per live event, at its stream ordering, in order.
        self.assertEqual([t for t, _ in events], list(range(1, current + 1)))
        # Synapse's layout: ["ev", [event_id, room_id, type, state_key,
        # redacts, relates_to, membership, rejected, outlier]].
        by_id = {row[1][0]: (t, row[1]) for t, row in events}
        room, message, redaction = history["room"], history["message"], history["redaction"]
        create = room.events[0]
        self.assertEqual(
            by_id[create.event_id][1],
            (create.event_id, room.room_id, "m.room.create", "", None, None, None, False, False),
        )
        self.assertEqual(
            by_id[room.events[3].event_id][1][2:], ("m.room.member", BOB, None, None, "join", False, False)
        )
        self.assertEqual(by_id[message.event_id][1][2:], ("m.room.message", None, None, None, None, False, False))
        self.assertEqual(
            by_id[redaction.event_id][1][2:], ("m.room.redaction", None, message.event_id, None, None, False, False)
        )
        self.assertEqual(by_id[history["leave"].event_id][1][6], "leave")
        # The first batch's state changes all sit at its last token, after its event.
        first_token = history["first_results"][-1].stream_ordering
        at_first = [row for t, row in updates if t == first_token]
        self.assertEqual(at_first[0][0], "ev")
        self.assertEqual(
            at_first[1:],
            [
                ("state", (room.room_id, "m.room.create", "", create.event_id)),
                ("state", (room.room_id, "m.room.member", ALICE, room.events[1].event_id)),
                ("state", (room.room_id, "m.room.member", BOB, room.events[3].event_id)),
                ("state", (room.room_id, "m.room.power_levels", "", room.events[2].event_id)),
            ],
        )
        leave_token = by_id[history["leave"].event_id][0]
        self.assertIn(
            (leave_token, ("state", (room.room_id, "m.room.member", BOB, history["leave"].event_id))), updates
        )
        # Backfilled events are not in the events stream.
        self.assertFalse({e.event_id for e in history["old_events"]} & set(by_id))

    async def test_paging_contract_on_every_stream(self):
        writer, _ = await open_pair(self, workers=())
        await populate(writer)
        for stream in store_stream_registry(writer):
            current = stream.current_token("master")
            everything = (await stream.get_updates("master", 0, current, BIG)).updates
            self.assertTrue(everything, stream.name)
            tokens = sorted({t for t, _ in everything})
            for limit in range(1, len(everything) + 2):
                await self.assert_contract(stream, 0, current, limit)
            # Ranges that start and end inside the stream.
            for start in (tokens[0], tokens[len(tokens) // 2]):
                for end in (tokens[-2], current):
                    if start < end:
                        for limit in (1, 2, 3, 5):
                            await self.assert_contract(stream, start, end, limit)

    async def test_pages_cut_on_token_boundaries(self):
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        events = EventsStream(writer)
        first_token = history["first_results"][-1].stream_ordering  # 1 ev + 4 state rows
        # limit 4: tokens 1..3 are single events, token 4 has 5 rows: the page
        # stops before it rather than splitting it.
        updates, upto, limited = await events.get_updates("master", 0, events.current_token("master"), 4)
        self.assertEqual([t for t, _ in updates], [1, 2, 3])
        self.assertEqual((upto, limited), (3, True))
        # From there, the 5-row token comes whole even though it exceeds the limit.
        updates, upto, limited = await events.get_updates("master", 3, events.current_token("master"), 2)
        self.assertEqual([t for t, _ in updates], [first_token] * 5)
        self.assertEqual((upto, limited), (first_token, True))
        # Exactly the rows of the range: not limited, even when they fill the page.
        updates, upto, limited = await events.get_updates("master", 0, 3, 3)
        self.assertEqual((len(updates), upto, limited), (3, 3, False))
        # An empty range and a bad limit.
        self.assertEqual(tuple(await events.get_updates("master", 5, 5, 10)), ([], 5, False))
        self.assertEqual(tuple(await events.get_updates("master", 7, 5, 10)), ([], 5, False))
        with self.assertRaises(ValueError):
            await events.get_updates("master", 0, 5, 0)

    async def test_backfill_tokens_are_positive(self):
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        stream = BackfillStream(writer)
        current = stream.current_token("master")
        self.assertEqual(current, 4)
        updates, upto, limited = await stream.get_updates("master", 0, current, BIG)
        self.assertEqual(([t for t, _ in updates], upto, limited), ([1, 2, 3, 4], 4, False))
        orderings = {r.event_id: r.stream_ordering for r in history["backfilled"]}
        self.assertTrue(all(o < 0 for o in orderings.values()))
        # Synapse's layout: [event_id, room_id, type, state_key, redacts, relates_to].
        for token, row in updates:
            self.assertEqual(len(row), 6)
            self.assertEqual(orderings[row[0]], -token)
        # The newest (deepest) backfilled event is nearest zero: token 1.
        old = history["old_events"]
        self.assertEqual([row[0] for _, row in updates], [e.event_id for e in reversed(old)])
        updates, upto, limited = await stream.get_updates("master", 1, current, 2)
        self.assertEqual(([t for t, _ in updates], upto, limited), ([2, 3], 3, True))

    async def test_caches_rows_of_a_batch_share_one_token(self):
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        stream = CachesStream(writer)
        current = stream.current_token("master")
        updates, _, _ = await stream.get_updates("master", 0, current, BIG)
        by_token: dict[int, list] = {}
        for token, (name, keys, ts) in updates:
            by_token.setdefault(token, []).append((name, keys))
            self.assertIsInstance(ts, int)
        room = history["room"]
        # The first batch: current state of the room and both members, one token.
        self.assertEqual(
            by_token[1],
            [(CURRENT_STATE_CACHE, [room.room_id]), (ROOMS_FOR_USER_CACHE, [ALICE]), (ROOMS_FOR_USER_CACHE, [BOB])],
        )
        redaction_rows = [rows for rows in by_token.values() if (EVENT_CACHE, [history["message"].event_id]) in rows]
        self.assertEqual(len(redaction_rows), 1)
        # The direct invalidations are the last two tokens; null keys survive.
        self.assertEqual(by_token[current - 1], [("custom_cache", None)])
        self.assertEqual(by_token[current], [("custom_cache", ["k1", "k2"])])
        # limit 1: the whole first token (3 rows), never a part of it.
        updates, upto, limited = await stream.get_updates("master", 0, current, 1)
        self.assertEqual(([t for t, _ in updates], upto, limited), ([1, 1, 1], 1, True))
        # limit 4 fits the first token but not the next multi-row one.
        updates, upto, limited = await stream.get_updates("master", 0, current, 4)
        self.assertEqual(len({t for t, _ in updates}), len(updates) - 2)
        self.assertLessEqual(len(updates), 4)

    async def test_position_never_passes_an_id_still_being_allocated(self):
        # A batch and a cache invalidation at once; the batch's transaction
        # has taken its IDs and not committed (nor has the reactor learnt
        # them) when the invalidation commits with a higher caches ID. The
        # stream must not claim the batch's ID complete: a worker would be
        # sent a position past a row it never gets. (Two batches no longer race so: persist_events writes in
        # call order, events/write/pipeline.py.)
        writer, _ = await open_pair(self, workers=())
        from roomstore.streams import reservations

        original = reservations._take_txn
        taken, go_on = threading.Event(), threading.Event()

        def take_then_wait(txn, gens, counts):
            ids = original(txn, gens, counts)
            if not taken.is_set():  # the batch's: its transaction waits here, IDs in hand
                taken.set()
                go_on.wait(10)
            return ids

        self.patch(reservations, "_take_txn", take_then_wait)
        room = UncheckedRoomBuilder("!first:example.org")
        slow = defer.ensureDeferred(writer.persist_events([room.to_persist(room.create())]))
        self.assertTrue(await threads.deferToThread(taken.wait, 10))
        fast = defer.ensureDeferred(writer.invalidate_cache("custom_cache", ["x"]))
        stream = CachesStream(writer)
        if self.engine_name == "postgres":
            # Committed beside the batch's open transaction (SQLite's one
            # connection waits for the batch instead).
            await wait_until(lambda: fast.called, what="the invalidation")
        self.assertEqual(stream.current_token("master"), 0)  # 1 is allocated, not written
        go_on.set()
        self.assertEqual((await slow)[0].stream_ordering, 1)
        self.assertEqual(await fast, 2)
        self.assertEqual(stream.current_token("master"), 2)
        updates = (await stream.get_updates("master", 0, 2, BIG)).updates
        self.assertEqual(sorted({t for t, _ in updates}), [1, 2])
        self.assertIn("custom_cache", [row[0] for t, row in updates if t == 2])

    async def test_wire_server_notifies_when_positions_move(self):
        from roomstore.events.write.persist import MissingStateError

        writer, _ = await open_pair(self, workers=())
        seen = []
        positions = []

        def notify(name):
            # Called once the position has moved: the rows are readable.
            seen.append(name)
            positions.append(writer.generators[name].get_current_token())

        stop = wire_server(writer, notify)
        room = UncheckedRoomBuilder()
        await writer.persist_events([room.to_persist(room.create())])
        self.assertEqual(sorted(seen), ["caches", "events"])
        self.assertEqual(positions, [1, 1])
        del seen[:]
        old = UncheckedRoomBuilder("!old:example.org")
        await writer.persist_events([old.to_persist(old.create(), backfilled=True)])
        self.assertEqual(sorted(seen), ["backfill", "caches"])
        del seen[:]
        stream_id = await writer.invalidate_cache("custom_cache", ["x"])
        self.assertEqual(seen, ["caches"])
        self.assertEqual(writer.caches_stream.get_current_token(), stream_id)
        del seen[:]
        # A batch failing in its write (past the precheck, as in a race with
        # another writer) writes nothing; the IDs its transaction took are
        # dropped with it: no position moves.
        skip_precheck(writer)
        orphan = UncheckedRoomBuilder(room.room_id)
        orphan.leaves = [fake_event_id("never stored")]
        with self.assertRaises(MissingStateError):
            await writer.persist_events([orphan.to_persist(orphan.message(ALICE, "no state"))])
        self.assertEqual(seen, [])
        del seen[:]
        stop()
        await writer.persist_events([room.to_persist(room.join(ALICE))])
        self.assertEqual(seen, [])


@on_both_engines
class StoreHandlerTests:
    """A worker's store fed RDATA and POSITION through a real client protocol."""

    async def setup_worker(self):
        self.writer, (self.worker,) = await open_pair(self)
        self.applied = []
        self.handler = StoreReplicationHandler(self.worker, on_applied=lambda *a: self.applied.append(a))
        self.factory = ReplicationClientFactory(self.handler, "worker1", "hs.example", clock=Clock())
        for (stream, writer), token in self.handler.initial_positions().items():
            self.factory.positions.set(stream, writer, token)
        self.protocol = self.factory.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        feed(self.protocol, "SERVER hs.example", "PING 0")
        self.addCleanup(self.protocol.connectionLost, None)
        self.streams = store_stream_registry(self.writer)

    async def deliver(self, stream_name: str, upto: int | None = None) -> int:
        """Send the worker, as RDATA, the writer's rows it has not applied."""
        stream = self.streams.get(stream_name)
        start = self.factory.positions.get(stream_name, "master")
        upto = stream.current_token("master") if upto is None else upto
        updates = (await stream.get_updates("master", start, upto, BIG)).updates
        feed(self.protocol, *rdata_lines(stream_name, updates))
        return upto

    async def test_initial_positions_are_the_stores(self):
        writer, (worker,) = await open_pair(self)
        room = UncheckedRoomBuilder()
        await writer.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        late = await type(worker).open(worker.db, worker.config)  # opened after the writes
        self.addCleanup(late.close)
        handler = StoreReplicationHandler(late)
        positions = dict(handler.initial_positions().items())
        self.assertEqual(positions, {("events", "master"): 2, ("backfill", "master"): 0, ("caches", "master"): 1})
        self.assertEqual(dict(StoreReplicationHandler(worker).initial_positions().items())[("events", "master")], 0)

    async def test_rdata_makes_the_writers_events_visible_on_the_worker(self):
        await self.setup_worker()
        writer, worker = self.writer, self.worker
        room = UncheckedRoomBuilder()
        create, join = room.create(), room.join(ALICE)
        message = room.message(ALICE, "hello")
        await writer.persist_events([room.to_persist(e) for e in (create, join, message)])
        start = worker.events_stream.get_current_token()
        # The worker caches what it reads before hearing about the next writes.
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset())
        self.assertEqual((await worker.get_event(message.event_id))["content"]["body"], "hello")
        bob_join = room.join(BOB)
        redaction = room.redact(ALICE, message.event_id)
        await writer.persist_events([room.to_persist(bob_join), room.to_persist(redaction)])
        target = writer.events_stream.get_current_token()
        # Not heard yet: position behind, caches stale.
        self.assertLess(worker.events_stream.get_current_token(), target)
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset())
        self.assertNotIn("redacted_because", (await worker.get_event(message.event_id)).get("unsigned", {}))

        waiter = worker.events_stream.wait_for_position(target)
        await self.deliver("events")
        self.assertEqual(await with_timeout(waiter, 10, "events position"), target)
        self.assertEqual(worker.events_stream.get_current_token(), target)
        self.assertEqual(worker.get_current_token(), writer.get_current_token())
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset([room.room_id]))
        redacted = await worker.get_event(message.event_id)
        self.assertEqual(redacted["unsigned"]["redacted_because"]["event_id"], redaction.event_id)
        self.assertNotIn("body", redacted["content"])
        self.assertEqual(await worker.get_event(bob_join.event_id), await writer.get_event(bob_join.event_id))
        self.assertEqual(
            await worker.get_current_state_ids(room.room_id), await writer.get_current_state_ids(room.room_id)
        )
        # Change caches: the room and Bob changed after `start`, Carol did not.
        self.assertTrue(worker.room_changes.has_entity_changed(room.room_id, start))
        self.assertEqual(worker.membership_changes.get_entities_changed([BOB, CAROL], start), {BOB})
        self.assertEqual(worker.room_changes.get_max_pos_of_last_change(room.room_id), target)
        # One on_applied per token, with its rows.
        self.assertEqual(
            [(s, i, t) for s, i, t, _ in self.applied], [("events", "master", t) for t in range(1, target + 1)]
        )
        self.assertEqual(self.factory.positions.get("events", "master"), target)

    async def test_position_moves_generators_and_fetches_missed_rows(self):
        await self.setup_worker()
        writer, worker = self.writer, self.worker
        room = UncheckedRoomBuilder()
        await writer.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        await self.deliver("events")
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset())  # cached
        # POSITION with no gap: the position moves, nothing is fetched.
        feed(self.protocol, "POSITION caches master 0 1")
        self.assertEqual(worker.caches_stream.get_current_token(), 1)
        # POSITION whose prev_token is ahead of the worker: it missed rows and
        # fetches them from the database (its own EventsStream) before moving.
        await writer.persist_events([room.to_persist(room.join(BOB))])
        await writer.persist_events([room.to_persist(room.message(BOB, "hi"))])
        target = writer.events_stream.get_current_token()
        waiter = worker.events_stream.wait_for_position(target)
        feed(self.protocol, f"POSITION events master {target} {target}")
        await with_timeout(waiter, 10, "events position")
        await wait_until(lambda: self.factory.positions.get("events", "master") == target, what="follower position")
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset([room.room_id]))
        self.assertEqual([t for s, _, t, _ in self.applied if s == "events"], [1, 2, 3, 4])
        # A backfill position is a plain advance too.
        feed(self.protocol, "POSITION backfill master 0 0")
        self.assertEqual(worker.backfill_stream.get_current_token(), 0)

    async def test_caches_stream_drops_named_caches(self):
        await self.setup_worker()
        writer, worker = self.writer, self.worker
        room = UncheckedRoomBuilder()
        events = [room.create(), room.join(ALICE)]
        await writer.persist_events([room.to_persist(e) for e in events])
        await self.deliver("events")
        await self.deliver("caches")
        custom = []
        self.handler.add_cache_handler("custom_cache", custom.append)

        async def cached() -> tuple[bool, bool]:
            await worker.get_event(events[0].event_id)
            await worker.get_rooms_for_user(ALICE)
            return events[0].event_id in worker.reader._events, ALICE in worker.reader._rooms_for_user

        self.assertEqual(await cached(), (True, True))
        for cache_name, keys, dropped in [
            (EVENT_CACHE, [events[0].event_id], (False, True)),
            (ROOMS_FOR_USER_CACHE, [BOB], (True, True)),
            (ROOMS_FOR_USER_CACHE, [ALICE], (True, False)),
            (ROOMS_FOR_USER_CACHE, None, (True, False)),
            (CURRENT_STATE_CACHE, [room.room_id], (True, False)),
            (CURRENT_STATE_CACHE, None, (True, False)),
            (EVENT_CACHE, None, (False, False)),
            ("custom_cache", ["k"], (True, True)),
        ]:
            self.assertEqual(await cached(), (True, True))
            token = await writer.invalidate_cache(cache_name, keys)
            waiter = worker.caches_stream.wait_for_position(token)
            await self.deliver("caches")
            await with_timeout(waiter, 10, "caches position")
            state = (events[0].event_id in worker.reader._events, ALICE in worker.reader._rooms_for_user)
            self.assertEqual(state, dropped, f"{cache_name} {keys}")
        self.assertEqual(custom, [["k"]])
        self.assertEqual(self.applied[-1][:3], ("caches", "master", writer.caches_stream.get_current_token()))

    async def test_backfilled_redaction_drops_the_cached_event(self):
        await self.setup_worker()
        writer, worker = self.writer, self.worker
        room = UncheckedRoomBuilder()
        create, join = room.create(), room.join(ALICE)
        message = room.message(ALICE, "hello")
        await writer.persist_events([room.to_persist(e) for e in (create, join, message)])
        await self.deliver("events")
        self.assertNotIn("redacted_because", (await worker.get_event(message.event_id)).get("unsigned", {}))
        # A redaction fetched from the past (a side branch off the join).
        redaction = room.redact(ALICE, message.event_id, prev=[join.event_id], set_leaves=False)
        await writer.persist_events([room.to_persist(redaction, backfilled=True)])
        waiter = worker.backfill_stream.wait_for_position(1)
        await self.deliver("backfill")
        await with_timeout(waiter, 10, "backfill position")
        self.assertEqual(
            (await worker.get_event(message.event_id))["unsigned"]["redacted_because"]["event_id"], redaction.event_id
        )


@on_both_engines
class StoreLoopbackTests:
    """Writer and worker stores joined by the real server and client factories
    over loopback TCP: rows flow as the writer persists them."""

    async def test_writes_reach_the_worker(self):
        writer, (worker,) = await open_pair(self)
        config = ReplicationConfig(page_size=3)
        server = ReplicationServerFactory("hs.example", store_stream_registry(writer), reactor, config)
        wire_server(writer, server.notify_new_rows)
        port = reactor.listenTCP(0, server, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        handler = StoreReplicationHandler(worker)
        client = ReplicationClientFactory(handler, "worker1", "hs.example", config=config)
        for (stream, instance), token in handler.initial_positions().items():
            client.positions.set(stream, instance, token)
        connector = reactor.connectTCP("127.0.0.1", port.getHost().port, client)

        async def stop():
            client.stop()
            connector.disconnect()
            server.close_all()
            await wait_until(lambda: not server.connections and client.connection is None, what="disconnect")

        self.addCleanup(stop)
        await wait_until(lambda: client.connection is not None and server.connections, what="connection")
        self.assertEqual(await worker.get_rooms_for_user(ALICE), frozenset())
        room = UncheckedRoomBuilder()
        events = [room.create(), room.join(ALICE)] + [room.message(ALICE, f"m{i}") for i in range(10)]
        for start in range(0, len(events), 4):
            await writer.persist_events([room.to_persist(e) for e in events[start : start + 4]])
        target = writer.events_stream.get_current_token()
        await with_timeout(worker.events_stream.wait_for_position(target), 10, "events on the worker")
        await with_timeout(
            worker.caches_stream.wait_for_position(writer.caches_stream.get_current_token()), 10, "caches on the worker"
        )
        self.assertEqual(await worker.get_rooms_for_user(ALICE), frozenset([room.room_id]))
        self.assertEqual((await worker.get_event(events[-1].event_id))["content"]["body"], "m9")


#: State keys and types a database's JSON must write as Python's json does:
#: quotes, backslashes, control characters, DEL, non-ASCII (BMP and astral).
AWKWARD = ['quote " back \\ slash', "tab\tnew\nline\x01\x1f", "del\x7f", "caf\u00e9 \u2028", "smile \U0001f600", ""]


async def populate_awkward(store) -> RoomBuilder:
    """A room whose state events carry ``AWKWARD`` types and state keys,
    and a member whose user ID is one of them."""
    room = UncheckedRoomBuilder("!awk\u00e9:example.org")
    events = [room.create(), room.join(ALICE)]
    for index, text in enumerate(AWKWARD):
        events.append(room.state(f"org.example.{text}", text, {"i": index}, sender=ALICE))
    events.append(room.message(ALICE, "after"))
    for start in range(0, len(events), 3):
        await store.persist_events([room.to_persist(e) for e in events[start : start + 3]])
    old = UncheckedRoomBuilder("!old\u00e9:example.org", creator=CAROL)
    await store.persist_events(
        [
            old.to_persist(e, backfilled=True)
            for e in (old.create(), old.join(CAROL), old.state("org.example.\x7f", "\U0001f600", {}, sender=CAROL))
        ]
    )
    return room


@on_both_engines
class EncodedPagesTests(ContractMixin):
    """``get_encoded_updates``: the server's pages, each row's JSON text as
    ``encode_row`` writes it (written by SQLite itself, by Python from the
    fields on PostgreSQL), in the same pages as ``get_updates``."""

    async def assert_encoded_like_rows(self, stream, limits) -> None:
        from roomstore.replication.commands import encode_row

        current = stream.current_token("master")
        for limit in limits:
            cursor = 0
            while True:
                rows = await stream.get_updates("master", cursor, current, limit)
                encoded = await stream.get_encoded_updates("master", cursor, current, limit)
                context = f"{stream.name} from {cursor} limit {limit}"
                self.assertEqual((encoded.upto_token, encoded.limited), (rows.upto_token, rows.limited), context)
                self.assertEqual([t for t, _ in encoded.updates], [t for t, _ in rows.updates], context)
                for (_, row), (_, text) in zip(rows.updates, encoded.updates, strict=True):
                    self.assertIsInstance(text, str)
                    self.assertEqual(text, encode_row(row), context)
                if not rows.limited:
                    break
                cursor = rows.upto_token

    async def test_every_row_encoded_as_encode_row_writes_it(self):
        writer, _ = await open_pair(self, workers=())
        await populate(writer)
        await populate_awkward(writer)
        for stream in (EventsStream(writer), BackfillStream(writer)):
            await self.assert_encoded_like_rows(stream, (1, 2, 3, 7, BIG))

    async def test_awkward_strings_survive_the_round_trip(self):
        """The rows' values are the stored strings (checked on the decoded
        JSON text, not only against the rows path)."""
        import json

        writer, _ = await open_pair(self, workers=())
        room = await populate_awkward(writer)
        stream = EventsStream(writer)
        encoded = (await stream.get_encoded_updates("master", 0, stream.current_token("master"), BIG)).updates
        self.assertTrue(all(text.isascii() and "\x7f" not in text for _, text in encoded))
        rows = [json.loads(text) for _, text in encoded]
        keys = {row[1][3] for row in rows if row[0] == "ev"} | {row[1][2] for row in rows if row[0] == "state"}
        self.assertLessEqual(set(AWKWARD), keys)
        self.assertIn(f"org.example.{AWKWARD[1]}", {row[1][2] for row in rows if row[0] == "ev"})
        self.assertEqual({row[1][1] for row in rows if row[0] == "ev"}, {room.room_id})
        backfill = BackfillStream(writer)
        old = (await backfill.get_encoded_updates("master", 0, backfill.current_token("master"), BIG)).updates
        self.assertEqual([json.loads(text)[2:4] for _, text in old][0], ["org.example.\x7f", "\U0001f600"])

    async def test_encoded_pages_keep_the_contract(self):
        """Every limit: the pages of ``get_encoded_updates`` joined are the
        whole range, each at most ``limit`` rows unless one token holds more."""
        writer, _ = await open_pair(self, workers=())
        await populate(writer)

        class Encoded:
            def __init__(self, stream):
                self.name, self.stream = stream.name, stream

            async def get_updates(self, *args):
                return await self.stream.get_encoded_updates(*args)

        for stream in (EventsStream(writer), BackfillStream(writer)):
            current = stream.current_token("master")
            everything = (await stream.get_updates("master", 0, current, BIG)).updates
            for limit in range(1, len(everything) + 2):
                await self.assert_contract(Encoded(stream), 0, current, limit)

    async def test_text_pages_hold_the_lines_of_the_row_pages(self):
        """``get_rdata_page``: the pages' lines (``RdataText``; on SQLite
        the database writes them, on PostgreSQL Python from the fields); every limit,
        the pages' lines together are the row pages' lines (one page of
        rows, ``feed._page_text``), a text page holds at most ``limit``
        events and the rows at their tokens, says its count, its first and
        last tokens (within its range) and its longest line, and a page with
        characters SQLite leaves as they are comes as rows."""
        from roomstore.replication.feed import _page_text
        from roomstore.replication.stream_interface import RdataText

        writer, _ = await open_pair(self, workers=())
        await populate(writer)
        ascii_only = {}
        for stream in (EventsStream(writer), BackfillStream(writer)):
            ascii_only[stream.name] = stream.current_token("master")
        await populate_awkward(writer)
        texts = 0
        for stream in (EventsStream(writer), BackfillStream(writer)):
            prefix = f"RDATA {stream.name} master "
            for current in (ascii_only[stream.name], stream.current_token("master")):
                whole = (await stream.get_encoded_updates("master", 0, current, BIG)).updates
                expected = _page_text(whole, 0, current, prefix, BIG)
                for limit in (1, 2, 3, 7, BIG):
                    context = f"{stream.name} up to {current}, limit {limit}"
                    got, cursor = [], 0
                    while cursor < current:
                        page = await stream.get_rdata_page("master", cursor, current, limit, prefix)
                        self.assertGreater(page.upto_token, cursor, context)
                        if type(page.updates) is RdataText:
                            texts += 1
                            text = page.updates.text
                            lines = text.split("\n")[:-1]
                            self.assertEqual(page.updates.count, len(lines), context)
                            self.assertEqual(page.updates.longest, max(map(len, lines)), context)
                            tokens = [int(line.split(" ")[3]) for line in lines if line.split(" ")[3] != "batch"]
                            self.assertEqual(
                                (page.updates.first, page.updates.last),
                                (
                                    int(lines[0].split(" ")[3]) if lines[0].split(" ")[3] != "batch" else tokens[0],
                                    tokens[-1],
                                ),
                                context,
                            )
                            self.assertTrue(cursor < page.updates.first <= page.updates.last <= page.upto_token)
                            self.assertLessEqual(
                                sum(line.startswith(f"{prefix}") and '["state"' not in line for line in lines),
                                limit,
                                context,
                            )
                            self.assertTrue(text.isascii(), context)
                        else:
                            text = _page_text(page.updates, cursor, page.upto_token, prefix, BIG) or ""
                        if page.limited:
                            self.assertEqual(
                                page.upto_token,
                                (page.updates.last if type(page.updates) is RdataText else page.updates[-1][0]),
                                context,
                            )
                        else:
                            self.assertEqual(page.upto_token, current, context)
                        got.append(text)
                        cursor = page.upto_token
                    self.assertEqual("".join(got), expected, context)
        self.assertGreater(texts, 0)

    async def test_field_pages_of_the_store(self):
        """``read_events_stream`` and ``read_backfill_stream``: fields, from
        the same page as the rows."""
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        current = writer.stream("events").get_current_token()
        events, state, more = await writer.read_events_stream("master", 0, current, BIG)
        rows, _ = await writer.read_events_stream_rows("master", 0, current, BIG)
        self.assertFalse(more)
        self.assertEqual(events, [(t, *r[1][:5], *r[1][6:]) for t, r in rows if r[0] == "ev"])
        self.assertEqual(state, [(t, *r[1]) for t, r in rows if r[0] == "state"])
        backfill, more = await writer.read_backfill_stream("master", 0, 4, BIG)
        self.assertEqual([e[1] for e in backfill], [e.event_id for e in reversed(history["old_events"])])
        self.assertTrue(all(len(e) == 6 for e in backfill))


@on_both_engines
class BatchApplyTests:
    """``StoreReplicationHandler.on_rdata_batch``: a worker store fed a
    read's tokens at once ends as one fed token by token."""

    async def test_batches_leave_the_worker_as_tokens_do(self):
        import random

        writer, (by_token, by_batch) = await open_pair(self, workers=("worker1", "worker2"))
        history = await populate(writer)
        await populate_awkward(writer)
        pages = await whole_pages(writer)
        applied = {"token": [], "batch": []}
        # on_applied sees each token's position, as after that token alone.
        one = StoreReplicationHandler(
            by_token,
            on_applied=lambda *a: applied["token"].append(
                (*a, by_token.stream(a[0]).get_current_token_for_writer("master"))
            ),
        )
        many = StoreReplicationHandler(
            by_batch,
            on_applied=lambda *a: applied["batch"].append(
                (*a, by_batch.stream(a[0]).get_current_token_for_writer("master"))
            ),
        )
        rng = random.Random(5)
        for name, updates in pages.items():
            grouped = rows_by_token(updates)
            for token, rows in grouped:
                one.on_rdata(name, "master", token, rows)
            start = 0
            while start < len(grouped):
                end = start + rng.choice([1, 2, 5, 50])
                many.on_rdata_batch(name, "master", grouped[start:end])
                start = end
        self.assertEqual(applied["batch"], applied["token"])
        self.assertTrue(all(position == token for _, _, token, _, position in applied["batch"]))
        assert_workers_agree(self, by_batch, by_token, writer, pages)
        for worker in (by_token, by_batch):
            self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset([history["other"].room_id]))
            self.assertEqual(
                await worker.get_rooms_for_user(ALICE), frozenset([history["room"].room_id, "!awk\u00e9:example.org"])
            )

    async def test_rows_leave_the_worker_as_tokens_do(self):
        """``on_rdata_rows``: a worker fed reads of rows as they come off the
        wire (decoded JSON, ``batch`` tokens None) ends as one fed token by
        token: positions, change caches, cached answers."""
        import json
        import random

        from roomstore.replication.commands import encode_row

        writer, (by_token, by_rows) = await open_pair(self, workers=("worker1", "worker2"))
        history = await populate(writer)
        await populate_awkward(writer)
        one, many = StoreReplicationHandler(by_token), StoreReplicationHandler(by_rows)
        rng = random.Random(7)
        pages = await whole_pages(writer)
        for name, updates in pages.items():
            grouped = rows_by_token(updates)
            for token, rows in grouped:
                one.on_rdata(name, "master", token, rows)
            start = 0
            while start < len(grouped):
                end = start + rng.choice([1, 2, 5, 50])
                tokens, wire_rows = [], []
                for token, rows in grouped[start:end]:
                    tokens += [None] * (len(rows) - 1) + [token]
                    wire_rows += [json.loads(encode_row(row)) for row in rows]
                many.on_rdata_rows(name, "master", tokens, wire_rows)
                start = end
        assert_workers_agree(self, by_rows, by_token, writer, pages)
        for worker in (by_token, by_rows):
            self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset([history["other"].room_id]))

    async def test_a_batch_drops_what_its_rows_change(self):
        writer, (worker,) = await open_pair(self)
        room = UncheckedRoomBuilder("!batch:example.org")
        await writer.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset())  # cached
        before = writer.stream("events").get_current_token()
        await writer.persist_events([room.to_persist(room.join(BOB))])
        await writer.persist_events([room.to_persist(room.message(BOB, "hi"))])
        stream = EventsStream(writer)
        updates = (await stream.get_updates("master", before, stream.current_token("master"), BIG)).updates
        grouped: dict[int, list] = {}
        for token, row in updates:
            grouped.setdefault(token, []).append(row)
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset())  # still the cached answer
        StoreReplicationHandler(worker).on_rdata_batch("events", "master", sorted(grouped.items()))
        self.assertEqual(await worker.get_rooms_for_user(BOB), frozenset([room.room_id]))
        self.assertEqual(worker.stream("events").get_current_token(), stream.current_token("master"))
        self.assertTrue(worker.room_changes.has_entity_changed(room.room_id, before))
