"""A worker's reads of many RDATA lines at once.

``parse_rdata_lines`` parses a run of lines in one go and the follower applies
a run's tokens in one call (``on_rdata_batch``); whatever the chunking of the
bytes, the outcome must be the line-by-line path's: the same rows applied per
token in the same order, the same positions, the same ERRORs, the same
closing. Seeded fuzzing compares the two paths on random scripts.
"""

from __future__ import annotations

import gc
import random

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from zope.interface import implementer

from roomstore.replication import (
    ClientReplicationProtocol,
    InMemoryStream,
    ReplicationClientFactory,
    ReplicationConfig,
    StreamRegistry,
)
from roomstore.replication.commands import RdataCommand, parse_rdata_fields, serialize_command
from roomstore.replication.handler_interface import IBatchHandler, IRowsHandler
from roomstore.replication.wire import parse_rdata_lines, parse_rdata_run

from .test_fuzz import SEED, _mutate
from .utils import RecordingHandler, written


def plain_line(stream: str, writer: str, token: int | None, row) -> str:
    return serialize_command(RdataCommand(stream, writer, token, row))


class ParseRunsTests(unittest.TestCase):
    def test_plain_lines_give_every_line_fields(self) -> None:
        lines = [
            plain_line("events", "master", None, ("ev", ["$a", "!r", "t", None, None, None, None, False, False])),
            plain_line("events", "master", 7, ("state", ["!r", "t", 'k\u00e9 "\\', None])),
            plain_line("caches", "w\u00f6rker", 12, ("c", None, 5)),
            'RDATA events master 0070 [1.5,-2,{"a":[]},"x"]',
        ]
        streams, instances, tokens, rows = parse_rdata_lines(lines)
        self.assertEqual(
            list(zip(streams, instances, tokens, rows, strict=True)), [parse_rdata_fields(line) for line in lines]
        )
        self.assertEqual(tokens, [None, 7, 12, 70])
        self.assertIs(type(rows[0]), list)

    def test_any_line_not_plain_gives_none(self) -> None:
        good = 'RDATA events master 1 ["a"]'
        for bad in (
            'RDATA events master 1 ["a"] ',  # whitespace after the row (valid, not plain)
            'RDATA events master 1 ["\u00e9"]',  # a non-ASCII row (valid, not plain)
            "RDATA events master 1 [NaN]",
            "RDATA events master 1 [1e999]",
            'RDATA events master -1 ["a"]',
            'RDATA events master 1x ["a"]',
            "RDATA events master 123456789012345678901 [1]",
            'RDATA events master  ["a"]',
            'RDATA  master 1 ["a"]',
            "RDATA ev\x01ents master 1 [1]",
            'RDATA events master 1 ["a"]\r',
            'RDATA events master 1 ["a"',
            'RDATA events master 1 ["a"]]',
            "RDATA events master 1",
            "POSITION events master 1 2",
            "",
        ):
            with self.subTest(bad=bad):
                self.assertIsNone(parse_rdata_lines([good, bad, good]))
        self.assertIsNone(parse_rdata_lines([]))

    def test_runs_agree_with_the_line_parser(self) -> None:
        """Random runs of written, mutated and made-up lines: a run that
        parses gives exactly each line's ``parse_rdata_fields``; a run of
        lines our encoder writes always parses."""
        rng = random.Random(SEED + 2)
        words = ["events", "caches", "backfill", "master", "w1"]
        parsed = 0
        for _ in range(3000):
            lines = []
            for _ in range(rng.randint(1, 6)):
                row = [rng.choice(["ev", "x", None, True, 1, -2.5, '\u00e9"\\\n']) for _ in range(rng.randint(0, 4))]
                line = plain_line(rng.choice(words), rng.choice(words), rng.choice([None, rng.randrange(10**6)]), row)
                if rng.random() < 0.1:
                    line = _mutate(rng, line.encode()).decode("utf-8", "replace").split("\n")[0]
                lines.append(line)
            run = parse_rdata_lines(lines)
            fields = [parse_rdata_fields(line) for line in lines]
            if run is None:
                written_plain = all(
                    f is not None and line == plain_line(*f) for f, line in zip(fields, lines, strict=True)
                )
                self.assertFalse(written_plain, lines)
            else:
                parsed += 1
                self.assertEqual(list(zip(*run, strict=True)), fields, lines)
        self.assertGreater(parsed, 1000)


class OneStreamRunTests(unittest.TestCase):
    """``parse_rdata_run``: a read's lines of one stream and writer as one text."""

    def test_agrees_with_the_run_parser(self) -> None:
        """Random runs of one stream and writer (written, mutated, made up):
        the text parses exactly when the lines do as a run, to the same
        fields; lines of several streams or writers never parse."""
        rng = random.Random(SEED + 4)
        parsed = 0
        for _ in range(3000):
            stream, writer = rng.choice(["events", "caches"]), rng.choice(["master", "w1"])
            lines = []
            for _ in range(rng.randint(1, 6)):
                row = [rng.choice(["ev", "x", None, True, 1, -2.5, '\u00e9"\\\n']) for _ in range(rng.randint(0, 4))]
                line = plain_line(stream, writer, rng.choice([None, rng.randrange(10**6)]), row)
                if rng.random() < 0.05:
                    line = plain_line(rng.choice(["events", "typing"]), rng.choice(["master", "w2"]), 1, row)
                if rng.random() < 0.1:
                    line = _mutate(rng, line.encode()).decode("utf-8", "replace").split("\n")[0]
                lines.append(line)
            run = parse_rdata_lines(lines)
            got = parse_rdata_run("\n".join(lines), len(lines))
            if got is None:
                self.assertTrue(
                    run is None or len(set(zip(run[0], run[1], strict=True))) > 1 or not "".join(lines).isascii(), lines
                )
                continue
            parsed += 1
            self.assertIsNotNone(run, lines)
            self.assertEqual(set(run[0]), {got[0]}, lines)
            self.assertEqual(set(run[1]), {got[1]}, lines)
            self.assertEqual((list(run[2]), list(run[3])), (list(got[2]), list(got[3])), lines)
        self.assertGreater(parsed, 1000)

    def test_lines_not_plain_give_none(self) -> None:
        good = 'RDATA events master 1 ["a"]'
        for bad in (
            'RDATA events master 1 ["a"] ',
            'RDATA events master 1x ["a"]',
            'RDATA events master  ["a"]',
            'RDATA events master 1 ["a"]\r',
            'RDATA events master 1 ["a"',
            "RDATA events master 1",
            "RDATA events master 123456789012345678901 [1]",
            'RDATA events w1 1 ["a"]',
            "RDATA events master 1 [NaN]",
            'RDATA events master 1 ["\u00e9"]',
            "RDATA events",
        ):
            with self.subTest(bad=bad):
                self.assertIsNone(parse_rdata_run("\n".join([good, bad, good]), 3))
        self.assertIsNone(parse_rdata_run("RDATA ev\x01ents master 1 [1]", 1))
        self.assertEqual(parse_rdata_run(good, 1), ("events", "master", [1], (["a"],)))


@implementer(IBatchHandler)
class BatchRecordingHandler(RecordingHandler):
    """Records as ``RecordingHandler`` does, taking a read's tokens in one
    call (``on_rdata_batch``), as the store's handler does."""

    def __init__(self, streams: StreamRegistry) -> None:
        super().__init__(streams)
        self.batch_calls = 0

    def on_rdata_batch(self, stream_name, instance_name, updates) -> None:
        self.batch_calls += 1
        tokens = [token for token, _ in updates]
        assert tokens == sorted(set(tokens)), tokens
        for token, rows in updates:
            self.on_rdata(stream_name, instance_name, token, rows)


@implementer(IRowsHandler)
class RowsRecordingHandler(BatchRecordingHandler):
    """Records as ``RecordingHandler`` does, taking a read's rows of one
    stream and writer in one call (``on_rdata_rows``), as the store's
    handler does."""

    rows_calls = 0

    def on_rdata_rows(self, stream_name, instance_name, tokens, rows) -> None:
        # A token's rows: those up to its line (None: batch), or given its
        # token each (a page read from the database).
        self.rows_calls += 1
        assert tokens[-1] is not None, tokens
        filled = list(tokens)
        for index in range(len(filled) - 2, -1, -1):
            if filled[index] is None:
                filled[index] = filled[index + 1]
        assert filled == sorted(filled), tokens
        held = []
        for index, (token, row) in enumerate(zip(filled, rows, strict=True)):
            held.append(tuple(row) if type(row) is list else row)
            if index + 1 == len(filled) or filled[index + 1] != token:
                self.on_rdata(stream_name, instance_name, token, held)
                held = []


def _registry() -> StreamRegistry:
    """What a POSITION ahead of the worker makes it fetch: some rows in
    memory per stream and writer (read at once: no Deferred waits)."""
    streams = []
    for name in ("events", "caches"):
        stream = InMemoryStream(name, writers=["master", "w1"])
        for writer in ("master", "w1"):
            for token in range(1, 400, 7):
                stream.append(writer, token, (name, writer, token, "fetched"))
        streams.append(stream)
    return StreamRegistry(streams)


def _client(handler, batches: bool):
    factory = ReplicationClientFactory(
        handler, "worker1", "hs", clock=Clock(), config=ReplicationConfig(max_batch_rows=6)
    )
    for name in ("events", "caches"):
        for writer in ("master", "w1"):
            factory.positions.set(name, writer, 0)
    protocol = factory.buildProtocol(None)
    if not batches:
        protocol._on_rdata_run = None  # line by line, as before runs
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(b"SERVER hs\nPING 0\n")
    transport.clear()
    return factory, protocol, transport


def _script(rng: random.Random, one_stream: bool = False) -> list[bytes]:
    """Lines a server (or a confused one) might send a worker (``one_stream``:
    mostly of events from master)."""
    tokens = {(s, w): 0 for s in ("events", "caches", "typing") for w in ("master", "w1")}
    choices = list(tokens)
    if one_stream:
        tokens = {("events", "master"): 0, ("caches", "w1"): 0}
        choices = [("events", "master")] * 9 + [("caches", "w1")]
    lines: list[bytes] = []
    for _ in range(rng.randint(1, 120)):
        stream, writer = rng.choice(choices)
        roll = rng.random()
        if roll < 0.6:
            step = rng.choice([1, 1, 1, 2, 0, -3])  # mostly forward; replays and repeats too
            token = max(1, tokens[(stream, writer)] + step)
            tokens[(stream, writer)] = max(tokens[(stream, writer)], token)
            for _ in range(rng.choice([0, 0, 0, 1, 2, 7])):  # a batch, sometimes too long
                lines.append(plain_line(stream, writer, None, [stream, rng.random()]).encode())
            lines.append(plain_line(stream, writer, token, [stream, token, "\u00e9" * rng.randint(0, 1)]).encode())
        elif roll < 0.7:
            lines.append(_mutate(rng, plain_line(stream, writer, 5, ["x"]).encode()).split(b"\n")[0])
        elif roll < 0.8:
            position = tokens[(stream, writer)]
            new = position + rng.choice([0, 3, 10])
            prev = rng.choice([position, new])
            tokens[(stream, writer)] = new
            lines.append(f"POSITION {stream} {writer} {prev} {new}".encode())
        elif roll < 0.9:
            lines.append(rng.choice([b"PING 1", b"", b"REMOTE_SERVER_UP hs2", b"NONSENSE", b"\xff\xfe"]))
        else:
            lines.append(plain_line(stream, writer, tokens[(stream, writer)], ["again"]).encode() + b"\r")
    return lines


class ChunkingTests(unittest.TestCase):
    def assert_chunked_as_line_by_line(self, rng, lines, one, sizes, context) -> None:
        """``lines`` fed to ``one``'s client (batches on) in chunks of sizes drawn
        from ``sizes`` (or all at once), and line by line to a plain handler's:
        both end alike (rows, positions, replies, the connection)."""
        data = b"".join(line + b"\n" for line in lines)
        many = RecordingHandler(_registry())
        factory_one, protocol_one, transport_one = _client(one, batches=True)
        factory_many, protocol_many, transport_many = _client(many, batches=False)
        offset = 0
        while offset < len(data):
            size = rng.choice([*sizes, len(data)])
            protocol_one.dataReceived(data[offset : offset + size])
            offset += size
        for line in lines:
            protocol_many.dataReceived(line + b"\n")
        self.assertEqual(one.rdata, many.rdata, context)
        self.assertEqual(one.positions, many.positions, context)
        self.assertEqual(sorted(factory_one.positions.items()), sorted(factory_many.positions.items()), context)
        self.assertEqual(written(transport_one), written(transport_many), context)
        self.assertEqual(protocol_one.is_open, protocol_many.is_open, context)

    def test_any_chunking_applies_what_line_by_line_applies(self) -> None:
        rng = random.Random(SEED + 3)
        batched_calls = 0
        for case in range(300):
            lines = _script(rng)
            one = BatchRecordingHandler(_registry())
            self.assert_chunked_as_line_by_line(rng, lines, one, (1, 7, 64, 500, 4096), f"case {case}: {lines!r}")
            batched_calls += one.batch_calls
        self.assertGreater(batched_calls, 300)

    def test_reads_of_one_stream_apply_what_line_by_line_applies(self) -> None:
        """A handler taking a read's rows at once (``on_rdata_rows``) ends as
        line by line does, whatever the chunking, on scripts mostly of one
        stream and writer (with their batches, replays, bad lines)."""
        rng = random.Random(SEED + 5)
        rows_calls = 0
        for case in range(300):
            lines = _script(rng, one_stream=True)
            one = RowsRecordingHandler(_registry())
            self.assert_chunked_as_line_by_line(rng, lines, one, (7, 64, 500, 4096), f"case {case}: {lines!r}")
            rows_calls += one.rows_calls
        self.assertGreater(rows_calls, 100)

    def test_a_page_is_applied_in_one_call(self) -> None:
        handler = BatchRecordingHandler(_registry())
        factory, protocol, _ = _client(handler, batches=True)
        lines = [plain_line("events", "master", token, ["e", token]) for token in range(1, 501)]
        lines.insert(100, plain_line("events", "master", None, ["batch row"]))
        protocol.dataReceived("".join(line + "\n" for line in lines).encode())
        self.assertEqual(handler.batch_calls, 1)
        self.assertEqual([token for _, _, token, _ in handler.rdata], list(range(1, 501)))
        self.assertEqual(handler.rdata[100][3], [("batch row",), ("e", 101)])
        self.assertEqual(factory.positions.get("events", "master"), 500)

    def test_a_failing_batch_is_applied_token_by_token(self) -> None:
        """One bad row costs only its token, as line by line (the tokens
        before it in the failed call are applied again: applying is
        idempotent)."""

        class Picky(BatchRecordingHandler):
            def on_rdata(self, stream_name, instance_name, token, rows):
                if token == 3:
                    raise ValueError("bad row")
                super().on_rdata(stream_name, instance_name, token, rows)

        handler = Picky(_registry())
        factory, protocol, _ = _client(handler, batches=True)
        protocol.dataReceived("".join(plain_line("events", "master", t, ["e", t]) + "\n" for t in range(1, 6)).encode())
        self.flushLoggedErrors(ValueError)
        self.assertEqual([token for _, _, token, _ in handler.rdata], [1, 2, 1, 2, 4, 5])
        self.assertEqual(factory.positions.get("events", "master"), 5)
        self.assertTrue(protocol.is_open)


class FillReadAheadTests(unittest.TestCase):
    """Filling from the database (``StreamFollower.catch_up``, a gap, Redis)
    with pages read ahead: every row once, in order, however the reads
    finish, never more than ``read_ahead`` reads at once besides the page
    applied."""

    def _fill(self, read_ahead: int, batches: bool, seed: int) -> None:
        from roomstore.replication.follower import StreamFollower, StreamPositions

        from .utils import GatedStream

        rng = random.Random(seed)
        events = InMemoryStream("events")
        expected = []
        for token in range(1, 301):
            rows = [("e", token, i) for i in range(1 + (rng.random() < 0.2) * rng.randint(1, 6))]
            events.append("master", token, *rows)
            expected.append((token, rows))
        gated = GatedStream(events)
        handler = {False: RecordingHandler, True: BatchRecordingHandler, "rows": RowsRecordingHandler}[batches](
            StreamRegistry([gated])
        )
        positions = StreamPositions()
        positions.set("events", "master", 0)
        follower = StreamFollower(handler, positions, page_size=10, read_ahead=read_ahead)
        follower.catch_up("events", "master", 300)
        most = 0
        while gated.waiting:
            most = max(most, len(gated.waiting))
            if rng.random() < 0.5:
                gated.release()  # the oldest
            else:  # the newest first
                args, gate = gated.waiting.pop()
                gate.callback(None)
        self.assertLessEqual(most, read_ahead)
        self.assertEqual([(token, rows) for _, _, token, rows in handler.rdata], expected)
        self.assertEqual(positions.get("events", "master"), 300)
        self.assertTrue(all(limit == 10 for *_, limit in gated.calls))
        return most

    def test_every_row_once_in_order(self) -> None:
        most = {}
        for read_ahead in (1, 2, 3):
            for batches in (False, True, "rows"):
                for seed in range(5):
                    with self.subTest(read_ahead=read_ahead, batches=batches, seed=seed):
                        most[read_ahead] = max(most.get(read_ahead, 0), self._fill(read_ahead, batches, seed))
        self.assertEqual(most, {1: 1, 2: 2, 3: 3})


class CollectorTests(unittest.TestCase):
    """A read's rows are made, applied and freed with the cyclic collector
    held off (``roomstore.storage.collector``): no collection walks them."""

    def setUp(self) -> None:
        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)
        gc.enable()

    def test_a_read_of_many_lines_brings_on_no_collection(self) -> None:
        @implementer(IBatchHandler)
        class Counting(RecordingHandler):
            tokens = 0
            paused = None

            def on_rdata_batch(self, stream_name, instance_name, updates) -> None:
                self.tokens += len(updates)  # keeps nothing of the rows
                self.paused = not gc.isenabled()

        handler = Counting(_registry())
        factory, protocol, _ = _client(handler, batches=True)
        data = "".join(
            plain_line(
                "events",
                "master",
                token,
                ["ev", [f"$e{token}", "!r", "m.room.message", None, None, None, None, False, False]],
            )
            + "\n"
            for token in range(1, 3001)
        ).encode()
        gc.collect()
        collections: list[int] = []

        def callback(phase, info):
            if phase == "start":
                collections.append(info["generation"])

        gc.callbacks.append(callback)
        self.addCleanup(gc.callbacks.remove, callback)
        protocol.dataReceived(data)
        self.assertEqual(handler.tokens, 3000)
        self.assertTrue(handler.paused)
        # None while the rows lived; at most one of the youngest generation
        # after (CPython's free lists keep the collector's count raised),
        # finding them gone. Line by line with the collector on: dozens.
        self.assertIn(collections, ([], [0]))
        self.assertTrue(gc.isenabled())
        self.assertEqual(factory.positions.get("events", "master"), 3000)


class DeclaredHooksTests(unittest.TestCase):
    """The optional hooks are used where declared, and only there."""

    def test_an_undeclared_on_rdata_batch_is_not_called(self) -> None:
        class Undeclared(RecordingHandler):
            batch_calls = 0

            def on_rdata_batch(self, stream_name, instance_name, updates) -> None:
                self.batch_calls += 1

        handler = Undeclared(_registry())
        factory, protocol, transport = _client(handler, batches=True)
        protocol.dataReceived(b"".join(b'RDATA events master %d ["r"]\n' % token for token in range(1, 6)))
        self.assertEqual(handler.batch_calls, 0)  # token by token, through on_rdata
        self.assertEqual(factory.positions.get("events", "master"), 5)
        self.assertEqual(written(transport), [])

    def test_a_declared_batch_handler_takes_a_read_at_once(self) -> None:
        handler = BatchRecordingHandler(_registry())
        factory, protocol, _ = _client(handler, batches=True)
        protocol.dataReceived(b"".join(b'RDATA events master %d ["r"]\n' % token for token in range(1, 6)))
        self.assertEqual(handler.batch_calls, 1)
        self.assertEqual(factory.positions.get("events", "master"), 5)

    def test_handlers_must_cover_the_inbound_commands(self) -> None:
        class Missing(ClientReplicationProtocol):
            def command_handlers(self):
                handlers = super().command_handlers()
                del handlers["POSITION"]
                return handlers

        with self.assertRaises(TypeError):
            Missing("w", None, Clock(), lambda protocol: None)
