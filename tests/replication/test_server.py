"""Server side: REPLICATE, live rows, legacy replay, paging, notifications."""

from __future__ import annotations

import json
from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial import unittest

from roomstore.replication import InMemoryStream, Stream, StreamRegistry, UnknownStreamError
from roomstore.replication.commands import Command, LockReleasedCommand, UserIpCommand, UserSyncCommand

from .utils import (
    CountingStream,
    GatedStream,
    connect,
    feed,
    make_server,
    rdata_tokens,
    seed_registry,
    take,
    written,
)


def _fill(stream: InMemoryStream, tokens: Sequence[int], rows_per_token: int = 1) -> None:
    for token in tokens:
        stream.append("master", token, *[[f"{stream.name}-{token}-{i}"] for i in range(rows_per_token)])


def _rows_sent(lines: Sequence[str]) -> list[str]:
    """The row payloads of RDATA lines, in order."""
    return [line.split(" ", 4)[4] for line in lines if line.startswith("RDATA ")]


class ReplicateTests(unittest.TestCase):
    def setUp(self) -> None:
        self.registry = seed_registry(position=7)
        self.factory = make_server(self.registry)
        self.protocol, self.transport = connect(self.factory)

    def test_bare_replicate_answers_every_stream_and_writer(self) -> None:
        self.registry.get("caches").advance("worker1", 3)
        feed(self.protocol, "REPLICATE")
        self.assertEqual(
            take(self.transport),
            [
                "POSITION events master 7 7",
                "POSITION backfill master 7 7",
                "POSITION caches master 7 7",
                "POSITION caches worker1 3 3",
            ],
        )

    def test_no_rows_before_replicate(self) -> None:
        """A connection is sent rows only for streams it asked about."""
        self.registry.get("events").append("master", 8, ["$e"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(self.transport), [])
        feed(self.protocol, "REPLICATE events NOW")
        self.assertEqual(take(self.transport), ["POSITION events master 8 8"])
        self.registry.get("caches").append("master", 8, ["c"])
        self.factory.notify_new_rows("caches")
        self.assertEqual(take(self.transport), [])

    def test_live_rows_follow_the_position(self) -> None:
        feed(self.protocol, "REPLICATE")
        take(self.transport)
        events = self.registry.get("events")
        events.append("master", 9, ["a"], ["b"])
        events.advance("master", 12)  # 10..12 carry no rows
        self.factory.notify_new_rows("events")
        # Rows, then a POSITION so the client knows 10..12 were empty.
        self.assertEqual(
            take(self.transport),
            [
                'RDATA events master batch ["a"]',
                'RDATA events master 9 ["b"]',
                "POSITION events master 9 12",
            ],
        )
        events.append("master", 13, ["c"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(self.transport), ['RDATA events master 13 ["c"]'])

    def test_repeated_replicate_reports_last_sent(self) -> None:
        feed(self.protocol, "REPLICATE events NOW")
        self.registry.get("events").append("master", 9, ["a"])
        self.factory.notify_new_rows("events")
        take(self.transport)
        feed(self.protocol, "REPLICATE events NOW")
        self.assertEqual(take(self.transport), ["POSITION events master 9 9"])

    def test_unknown_stream_is_answered_and_connection_kept(self) -> None:
        with capturedLogs() as logs:
            feed(self.protocol, "REPLICATE typing 5")
        self.assertEqual(take(self.transport), ["ERROR unknown stream 'typing'"])
        self.assertTrue(any("unknown stream" in e.get("log_format", "") for e in logs))
        self.assertTrue(self.protocol.is_open)
        feed(self.protocol, "REPLICATE events 7")
        self.assertEqual(take(self.transport), ["POSITION events master 7 7"])

    def test_legacy_all_now(self) -> None:
        feed(self.protocol, "REPLICATE ALL NOW")
        self.assertEqual(len(take(self.transport)), 3)

    def test_legacy_token_ahead_of_server_is_clamped(self) -> None:
        with capturedLogs() as logs:
            feed(self.protocol, "REPLICATE events 100")
        self.assertEqual(take(self.transport), ["POSITION events master 7 7"])
        self.assertTrue(any("ahead of" in e.get("log_format", "") for e in logs))

    def test_writer_appearing_later_is_sent_from_the_start(self) -> None:
        feed(self.protocol, "REPLICATE caches NOW")
        take(self.transport)
        caches = self.registry.get("caches")
        caches.append("worker2", 4, ["w2"])
        self.factory.notify_new_rows("caches")
        self.assertEqual(take(self.transport), ['RDATA caches worker2 4 ["w2"]'])

    def test_notify_unknown_stream_is_a_caller_bug(self) -> None:
        with self.assertRaises(UnknownStreamError):
            self.factory.notify_new_rows("nope")

    def test_broken_stream_is_logged_and_retried(self) -> None:
        class Broken(Stream):
            name = "broken"
            fail = True

            def writers(self) -> Sequence[str]:
                return ["master"]

            def current_token(self, instance_name: str) -> int:
                return 5

            async def get_updates(self, instance_name, from_token, upto_token, limit):
                if self.fail:
                    raise RuntimeError("database on fire")
                return [(5, ("ok",))], upto_token, False

        broken = Broken()
        registry = StreamRegistry([broken])
        factory = make_server(registry)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE broken 0")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(take(transport), [])
        self.assertTrue(protocol.is_open)
        broken.fail = False
        factory.notify_new_rows("broken")
        self.assertEqual(take(transport), ['RDATA broken master 5 ["ok"]', "POSITION broken master 5 5"])
        # The notification got there first: the timed retry is dropped.
        self.assertEqual([c for c in factory.reactor.getDelayedCalls() if "_retry" in repr(c.func)], [])

    def test_broken_stream_is_retried_on_a_timer_without_new_rows(self) -> None:
        """No notification may ever come (the writer is idle): the feed tries
        again after 1 s, then 2 s, ... until the stream answers."""
        calls = []

        class Flaky(Stream):
            name = "flaky"
            failures = 2

            def writers(self) -> Sequence[str]:
                return ["master"]

            def current_token(self, instance_name: str) -> int:
                return 5

            async def get_updates(self, instance_name, from_token, upto_token, limit):
                calls.append(clock.seconds())
                if self.failures:
                    self.failures -= 1
                    raise RuntimeError("database restarting")
                return [(5, ("ok",))], upto_token, False

        clock = Clock()
        factory = make_server(StreamRegistry([Flaky()]), clock)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE flaky 0")
        self.assertEqual(take(transport), [])
        clock.advance(1)  # second try, fails too; the next waits 2 s
        self.assertEqual(take(transport), [])
        clock.advance(1.5)
        self.assertEqual(take(transport), [])
        clock.advance(0.5)
        self.assertEqual(take(transport), ['RDATA flaky master 5 ["ok"]', "POSITION flaky master 5 5"])
        self.assertEqual(calls, [0, 1, 3])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)
        self.assertEqual([c for c in clock.getDelayedCalls() if "_retry" in repr(c.func)], [])
        clock.advance(100)
        self.assertEqual(calls, [0, 1, 3])

    def test_no_retry_after_the_connection_closes(self) -> None:
        class Broken(Stream):
            name = "broken"

            def writers(self) -> Sequence[str]:
                return ["master"]

            def current_token(self, instance_name: str) -> int:
                return 5

            async def get_updates(self, instance_name, from_token, upto_token, limit):
                raise RuntimeError("down")

        clock = Clock()
        factory = make_server(StreamRegistry([Broken()]), clock)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE broken 0")
        self.flushLoggedErrors(RuntimeError)
        retries = [c for c in clock.getDelayedCalls() if "_retry" in repr(c.func)]
        self.assertEqual(len(retries), 1)
        transport.loseConnection()
        protocol.connectionLost(None)
        self.assertFalse(retries[0].active())


class ClientNotificationTests(unittest.TestCase):
    def test_registered_handlers_get_client_commands(self) -> None:
        factory = make_server()
        protocol, transport = connect(factory)
        received: list[tuple[object, Command]] = []
        names = [
            "USER_SYNC",
            "CLEAR_USER_SYNC",
            "FEDERATION_ACK",
            "REMOTE_SERVER_UP",
            "USER_IP",
            "LOCK_RELEASED",
            "NEW_ACTIVE_TASK",
            "CANCEL_TASK",
        ]
        for name in names:
            factory.add_command_handler(name, lambda conn, cmd: received.append((conn, cmd)))
        feed(
            protocol,
            "USER_SYNC worker1 @a:b DEV start 100",
            "CLEAR_USER_SYNC worker1",
            "FEDERATION_ACK fed 42",
            "REMOTE_SERVER_UP matrix.org",
            'USER_IP @a:b ["tok","::1","curl",null,5]',
            'LOCK_RELEASED ["worker1","purge","!r:b"]',
            "NEW_ACTIVE_TASK abc",
            "CANCEL_TASK abc",
        )
        self.assertEqual([cmd.NAME for _, cmd in received], names)
        self.assertTrue(all(conn is protocol for conn, _ in received))
        self.assertEqual(received[0][1], UserSyncCommand("worker1", "@a:b", "DEV", True, 100))
        self.assertEqual(received[4][1], UserIpCommand("@a:b", "tok", "::1", "curl", None, 5))
        self.assertEqual(received[5][1], LockReleasedCommand("worker1", "purge", "!r:b"))
        self.assertEqual(take(transport), [])

    def test_failing_handler_is_logged_not_fatal(self) -> None:
        factory = make_server()
        protocol, transport = connect(factory)

        def explode(conn, cmd):
            raise ValueError("boom")

        factory.add_command_handler("FEDERATION_ACK", explode)
        feed(protocol, "FEDERATION_ACK fed 1")
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        self.assertTrue(protocol.is_open)

    def test_only_notifications_take_handlers(self) -> None:
        with self.assertRaises(ValueError):
            make_server().add_command_handler("REPLICATE", lambda conn, cmd: None)

    def test_remote_server_up_broadcast(self) -> None:
        factory = make_server()
        (_, ta), (_, tb) = connect(factory), connect(factory)
        factory.send_remote_server_up("matrix.org")
        self.assertEqual(written(ta), ["REMOTE_SERVER_UP matrix.org"])
        self.assertEqual(written(tb), ["REMOTE_SERVER_UP matrix.org"])


class LegacyResumeTests(unittest.TestCase):
    """``REPLICATE <stream> <token>``: replay, then live, no gaps or duplicates."""

    def setUp(self) -> None:
        self.events = InMemoryStream("events")
        # 30 tokens; every third one holds a batch of three rows.
        for token in range(1, 31):
            _fill(self.events, [token], rows_per_token=3 if token % 3 == 0 else 1)
        self.gated = GatedStream(self.events)
        self.factory = make_server(StreamRegistry([self.gated]), page_size=10)
        self.protocol, self.transport = connect(self.factory)

    def expected_rows(self, after: int, upto: int) -> list[str]:
        """The RDATA payloads the client must get for (after, upto]."""
        return [json.dumps(list(row)) for token, row in self.events.rows("master") if after < token <= upto]

    def release_all(self, write_between=None) -> int:
        """Release reads one by one until none are waiting; optionally write
        new rows between reads. Returns how many reads there were."""
        reads = 0
        while self.gated.waiting:
            self.gated.release()
            reads += 1
            if write_between is not None:
                write_between(reads)
        return reads

    def test_replay_with_live_rows_arriving_mid_replay(self) -> None:
        feed(self.protocol, "REPLICATE events 5")
        self.assertEqual(len(self.gated.waiting), 1)  # the replay's first read is in flight
        next_token = [31]

        def live_write(reads: int) -> None:
            # While the replay is still catching up, new rows are committed
            # and the server is told at once.
            if reads <= 4:
                _fill(self.events, [next_token[0]], rows_per_token=2)
                next_token[0] += 1
                self.factory.notify_new_rows("events")

        # Before the first read returns, more rows arrive too.
        _fill(self.events, [next_token[0]])
        next_token[0] += 1
        self.factory.notify_new_rows("events")
        self.assertEqual(len(self.gated.waiting), 1)  # held: no second reader

        self.release_all(write_between=live_write)
        lines = take(self.transport)
        final = self.events.current_token("master")
        self.assertEqual(final, 35)
        # Every row after 5, each exactly once, in token order, and then the
        # POSITION that ends the replay.
        self.assertEqual(_rows_sent(lines), self.expected_rows(5, final))
        numeric = [int(t) for t in rdata_tokens(lines) if t != "batch"]
        self.assertEqual(numeric, list(range(6, final + 1)))
        self.assertEqual(lines[-1], f"POSITION events master {final} {final}")
        # Each read was a bounded page.
        self.assertTrue(all(limit == 10 for _, _, _, limit in self.gated.calls))

        # Live rows after the replay flow straight through.
        _fill(self.events, [36])
        self.factory.notify_new_rows("events")
        self.release_all()
        self.assertEqual(take(self.transport), ['RDATA events master 36 ["events-36-0"]'])

    def test_rewind_while_a_read_is_in_flight(self) -> None:
        """A legacy REPLICATE arriving while a live read is in flight throws
        that page away and restarts from the requested token."""
        feed(self.protocol, "REPLICATE events NOW")
        take(self.transport)
        _fill(self.events, [31, 32])
        self.factory.notify_new_rows("events")
        self.assertEqual(self.gated.waiting[0][0], ("master", 30, 32, 10))
        feed(self.protocol, "REPLICATE events 27")
        self.release_all()
        lines = take(self.transport)
        self.assertEqual(_rows_sent(lines), self.expected_rows(27, 32))
        self.assertEqual(lines[-1], "POSITION events master 32 32")

    def test_batches_are_never_split_across_pages(self) -> None:
        feed(self.protocol, "REPLICATE events 0")
        self.release_all()
        tokens = rdata_tokens(take(self.transport))
        # Every "batch" run is closed by its token line before the next token.
        run = 0
        for token in tokens:
            if token == "batch":
                run += 1
            else:
                self.assertIn(run, (0, 2))
                self.assertEqual(run == 2, int(token) % 3 == 0)
                run = 0
        self.assertEqual(run, 0)


class _HeldStream(Stream):
    """Wraps a stream; each get_updates waits until the test releases it."""

    def __init__(self, inner: Stream) -> None:
        self.inner = inner
        self.name = inner.name
        self.held: list[tuple[tuple[int, int, int], Deferred]] = []
        self.calls: list[tuple[int, int, int]] = []

    def writers(self) -> Sequence[str]:
        return self.inner.writers()

    def current_token(self, instance_name: str) -> int:
        return self.inner.current_token(instance_name)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int):
        gate: Deferred = Deferred()
        self.calls.append((from_token, upto_token, limit))
        self.held.append(((from_token, upto_token, limit), gate))
        await gate
        return await self.inner.get_updates(instance_name, from_token, upto_token, limit)


class FarBehindTests(unittest.TestCase):
    def test_pages_read_ahead_arrive_in_order(self) -> None:
        """With pages read ahead and answered in any order (the last asked
        first), every row is sent once, in token order; never more than
        ``read_ahead`` reads are in flight, each of at most ``page_size``
        rows; rows per token vary, so some pages come
        back short and the rest of their range is read next."""
        events = InMemoryStream("events")
        for token in range(1, 301):
            events.append("master", token, *[[f"e-{token}-{i}"] for i in range(1 + (token % 7 == 0) * 4)])
        held = _HeldStream(events)
        factory = make_server(StreamRegistry([held]), page_size=10, read_ahead=3)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE events 0")
        most = 0
        while held.held:
            most = max(most, len(held.held))
            waiting, held.held = held.held, []
            for _call, gate in reversed(waiting):
                gate.callback(None)
        self.assertLessEqual(most, 3)
        self.assertGreater(most, 1)
        self.assertTrue(all(limit == 10 for *_, limit in held.calls))
        lines = written(transport)
        expected = [f'["e-{t}-{i}"]' for t in range(1, 301) for i in range(1 + (t % 7 == 0) * 4)]
        self.assertEqual(_rows_sent(lines), expected)
        numeric = [int(t) for t in rdata_tokens(lines) if t != "batch"]
        self.assertEqual(numeric, list(range(1, 301)))
        self.assertEqual(lines[-1], "POSITION events master 300 300")
        self.assertTrue(protocol.session.feed.is_idle())

    def test_the_next_page_is_asked_for_before_one_is_written(self) -> None:
        """With one read at a time (``read_ahead=1``, as on SQLite), the
        next page is read while a page is encoded and written, not after."""
        events = InMemoryStream("events")
        _fill(events, range(1, 31))
        gated = GatedStream(events)
        factory = make_server(StreamRegistry([gated]), page_size=10, read_ahead=1)
        protocol, transport = connect(factory)
        reads_at_write: list[int] = []
        original_write = transport.write

        def write(data: bytes) -> None:
            if b"RDATA" in data:
                reads_at_write.append(len(gated.calls))
            original_write(data)

        transport.write = write
        feed(protocol, "REPLICATE events 0")
        while gated.waiting:
            self.assertEqual(len(gated.waiting), 1)  # never more than read_ahead in flight
            gated.release()
        self.assertEqual(rdata_tokens(written(transport)), [str(t) for t in range(1, 31)])
        # Page 1 went out with page 2's read asked for, page 2 with page 3's.
        self.assertEqual(reads_at_write[:2], [2, 3])

    def test_a_page_read_while_paused_waits_whole(self) -> None:
        """A page that arrives once another stream's page has filled the
        transport is written when it drains, in one write: it never goes
        line by line into the connection's pending queue (whose limit drops
        a client)."""
        events, caches = InMemoryStream("events"), InMemoryStream("caches")
        _fill(events, range(1, 31))
        _fill(caches, range(1, 11), rows_per_token=2)
        gated = GatedStream(caches)
        factory = make_server(StreamRegistry([events, gated]), page_size=100, max_pending_commands=5)
        protocol, transport = connect(factory)
        original_write = transport.write
        writes: list[bytes] = []

        def write(data: bytes) -> None:
            original_write(data)
            writes.append(data)
            if b"RDATA events" in data:
                protocol.outbound.pauseProducing()

        transport.write = write
        feed(protocol, "REPLICATE caches 0", "REPLICATE events 0")  # caches' read waits; events' page pauses
        self.assertTrue(protocol.paused)
        gated.release()  # the caches page arrives while paused
        self.assertEqual([cmd.NAME for cmd in protocol.outbound._pending], ["POSITION"])  # the events loop's last word
        self.assertFalse(any(b"RDATA caches" in data for data in writes))
        protocol.outbound.resumeProducing()
        self.assertTrue(protocol.is_open)
        caches_writes = [data for data in writes if b"RDATA caches" in data]
        self.assertEqual(len(caches_writes), 1)
        self.assertEqual(caches_writes[0].count(b"\n"), 20)
        self.assertEqual(
            rdata_tokens([line for line in written(transport) if line.startswith("RDATA caches")]),
            [t for token in range(1, 11) for t in ("batch", str(token))],
        )

    def test_far_behind_client_caught_up_in_bounded_pages(self) -> None:
        events = InMemoryStream("events")
        _fill(events, range(1, 1001))
        counting = CountingStream(events)
        factory = make_server(StreamRegistry([counting]), Clock(), page_size=100)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE events 0")
        lines = take(transport)
        self.assertEqual(rdata_tokens(lines), [str(t) for t in range(1, 1001)])
        self.assertEqual(lines[-1], "POSITION events master 1000 1000")
        self.assertEqual(len(counting.calls), 10)
        self.assertTrue(all(limit == 100 for *_, limit in counting.calls))
        self.assertEqual(counting.page_sizes, [100] * 10)
        # Each page starts where the previous ended.
        self.assertEqual([start for _, start, _, _ in counting.calls], list(range(0, 1000, 100)))

    def test_paging_waits_for_a_congested_connection(self) -> None:
        """A far-behind client that cannot keep up holds at most ``read_ahead``
        pages in memory besides the one written: the next page is read only
        when the transport resumes and a page went out."""
        for read_ahead in (1, 2, 3):
            with self.subTest(read_ahead=read_ahead):
                self._paging_waits(read_ahead)

    def _paging_waits(self, read_ahead: int) -> None:
        events = InMemoryStream("events")
        _fill(events, range(1, 501))
        counting = CountingStream(events)
        factory = make_server(
            StreamRegistry([counting]), page_size=100, max_pending_commands=150, read_ahead=read_ahead
        )
        protocol, transport = connect(factory)
        # The transport fills with the first page (written in one write).
        original_write = transport.write
        writes = [0]

        def write(data: bytes) -> None:
            original_write(data)
            writes[0] += 1
            if writes[0] == 1:
                protocol.outbound.pauseProducing()

        transport.write = write
        feed(protocol, "REPLICATE events 0")
        # One page written, `read_ahead` read ahead (while the first was
        # being written), none further.
        self.assertEqual(len(counting.calls), 1 + read_ahead)
        self.assertEqual(len(rdata_tokens(written(transport))), 100)
        self.assertEqual(protocol.pending_count, 0)
        self.assertTrue(protocol.is_open)
        # Each resume lets exactly one more page through.
        for page in range(2, 6):
            writes[0] = 0
            protocol.outbound.resumeProducing()
            self.assertEqual(len(counting.calls), min(page + read_ahead, 5))
            self.assertEqual(len(rdata_tokens(written(transport))), page * 100)
            self.assertLessEqual(protocol.pending_count, 100)
        protocol.outbound.resumeProducing()
        self.assertEqual(rdata_tokens(written(transport)), [str(t) for t in range(1, 501)])
        self.assertTrue(protocol.is_open)


class _SplittingStream(InMemoryStream):
    """Rows ``[name, [keys...]]``: a long one splits into rows with fewer keys."""

    def split_row(self, row, fits):
        name, keys = row
        parts, current = [], []
        for key in keys:
            if not fits((name, [key])):
                return None
            if current and not fits((name, current + [key])):
                parts.append((name, current))
                current = []
            current.append(key)
        parts.append((name, current))
        return parts


class PageWritingTests(unittest.TestCase):
    """A page is written the same whether or not every line is ASCII."""

    def test_writer_name_outside_ascii(self) -> None:
        for writer in ("master", "w\u00f6rker"):
            with self.subTest(writer=writer):
                events = InMemoryStream("events")
                events.append(writer, 1, ["$a"])
                events.append(writer, 2, ["$b"], ["$c"])
                factory = make_server(StreamRegistry([events]))
                protocol, transport = connect(factory)
                feed(protocol, "REPLICATE events 0")
                self.assertEqual(
                    [line for line in written(transport) if line.split(" ")[2] == writer],
                    [
                        f'RDATA events {writer} 1 ["$a"]',
                        f'RDATA events {writer} batch ["$b"]',
                        f'RDATA events {writer} 2 ["$c"]',
                        f"POSITION events {writer} 2 2",
                    ],
                )

    def test_a_page_is_made_and_written_with_the_collector_held_off(self) -> None:
        """Its lines go out while the cyclic collector is paused
        (``storage.collector``), which is on again once the page is sent."""
        import gc

        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)
        gc.enable()
        events = InMemoryStream("events")
        for token in range(1, 301):
            events.append("master", token, ["$e", token])
        factory = make_server(StreamRegistry([events]), page_size=100)
        protocol, transport = connect(factory)
        paused_at_write = []
        write = transport.write
        transport.write = lambda data: (paused_at_write.append(not gc.isenabled()), write(data))
        feed(protocol, "REPLICATE events 0")
        self.assertEqual(len([line for line in written(transport) if line.startswith("RDATA")]), 300)
        self.assertEqual(paused_at_write[:3], [True, True, True])
        self.assertTrue(gc.isenabled())

    def test_a_page_made_at_once_is_the_page_line_by_line(self) -> None:
        """``_page_text`` (the usual page: its lines made at once) writes
        exactly what the page's items write through ``send_rows``, and
        declines (None) every page they would not write as plain lines."""
        import random

        from roomstore.replication.feed import _page_text

        rng = random.Random(27)
        for _ in range(400):
            writer = rng.choice(["master", "w\u00f6rker"])
            start = rng.randrange(5)
            tokens = sorted(rng.randrange(start + 1, start + 30) for _ in range(rng.randint(1, 12)))
            if rng.random() < 0.1:
                rng.shuffle(tokens)
            updates = [
                (
                    token,
                    json.dumps([rng.choice(["a", "\u00e9", "x" * rng.randrange(40)]), token], separators=(",", ":")),
                )
                for token in tokens
            ]
            upto = max(tokens) + rng.choice([0, 0, 3, -1])
            limit = rng.choice([60, 200])
            factory = make_server(StreamRegistry([InMemoryStream("events")]), max_line_length=limit)
            protocol, transport = connect(factory)
            text = _page_text(updates, start, upto, f"RDATA events {writer} ", limit)
            following = tokens[1:] + [None]
            shown = ["batch" if t == n else t for t, n in zip(tokens, following, strict=True)]
            plain = (
                tokens == sorted(tokens)
                and upto >= tokens[-1]
                and all(
                    len(f"RDATA events {writer} {t} {j}") <= limit and (writer + j).isascii()
                    for t, (_, j) in zip(shown, updates, strict=True)
                )
            )
            self.assertEqual(text is not None, plain, (writer, tokens, upto))
            if text is None:
                continue
            protocol.send_rows(
                "events",
                writer,
                [(None if t == n else t, None, j) for (t, j), n in zip(updates, following, strict=True)],
            )
            self.assertEqual(text.encode(), transport.value())


class LineLimitTests(unittest.TestCase):
    """No line over max_line_length leaves the server, and no row is lost."""

    def setUp(self) -> None:
        self.stream = _SplittingStream("caches")
        self.registry = StreamRegistry([self.stream])
        self.factory = make_server(self.registry, max_line_length=120)
        self.protocol, self.transport = connect(self.factory)
        feed(self.protocol, "REPLICATE")
        take(self.transport)

    def test_long_row_is_split_at_its_token(self) -> None:
        keys = [f"key-{i:03d}" for i in range(40)]
        self.stream.append("master", 1, ("c", keys))
        self.factory.notify_new_rows("caches")
        lines = take(self.transport)
        self.assertGreater(len(lines), 2)
        self.assertTrue(all(len(line.encode()) <= 120 for line in lines), lines)
        tokens = [line.split(" ")[3] for line in lines]
        self.assertEqual(tokens, ["batch"] * (len(lines) - 1) + ["1"])
        sent = [json.loads(line.split(" ", 4)[4]) for line in lines]
        self.assertEqual([k for _, part in sent for k in part], keys)
        self.assertTrue(self.protocol.is_open)

    def test_unsplittable_row_makes_the_client_fetch_its_token(self) -> None:
        """POSITION <token> <token> instead of the row: prev_token ahead of the
        client's position is what makes a client fetch the rows itself."""
        self.stream.append("master", 1, ("c", ["short"]))
        self.stream.append("master", 2, ("c", ["x" * 200]), ("c", ["sibling"]))
        self.stream.append("master", 3, ("c", ["after"]))
        self.factory.notify_new_rows("caches")
        self.assertEqual(
            take(self.transport),
            [
                'RDATA caches master 1 ["c",["short"]]',
                "POSITION caches master 2 2",
                'RDATA caches master 3 ["c",["after"]]',
            ],
        )
        self.assertTrue(self.protocol.is_open)
        # Our follower, given that POSITION, fetches token 2 from its own
        # reading of the stream and applies it whole.
        from roomstore.replication import ReplicationClientHandler
        from roomstore.replication.client import ReplicationClientFactory

        applied = []

        class Handler(ReplicationClientHandler):
            def on_rdata(self, stream_name, instance_name, token, rows):
                applied.append((token, rows))

        client = ReplicationClientFactory(Handler(self.registry), "w", None, clock=Clock())
        client.positions.set("caches", "master", 0)
        protocol = client.buildProtocol(None)
        protocol.makeConnection(StringTransport())
        feed(
            protocol,
            "SERVER x",
            'RDATA caches master 1 ["c",["short"]]',
            "POSITION caches master 2 2",
            'RDATA caches master 3 ["c",["after"]]',
        )
        self.assertEqual(
            applied, [(1, [("c", ["short"])]), (2, [("c", ["x" * 200]), ("c", ["sibling"])]), (3, [("c", ["after"])])]
        )
        protocol.connectionLost(None)
