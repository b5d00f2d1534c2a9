"""Interoperability with Synapse's replication protocol, checked against the
matrix-synapse package (1.163, installed by the test set-up) used as an
oracle: its command parser, its stream row parsers and its client protocol.

- Every line a roomstore server sends (all three store streams, replayed from
  token 0 and live, batches, a split invalidation) parses with Synapse's
  ``parse_command_from_line``, re-serialises byte for byte, is within its
  16 KiB line limit, and every row parses with ``STREAMS_MAP[name].parse_row``
  into the values the store holds.
- Lines written by Synapse's own command objects are taken by roomstore's
  server and client protocols without ERROR and reach the handlers.
- Synapse's ``ClientReplicationStreamProtocol`` connects over loopback TCP to
  a separate roomstore server process and receives live rows (and a large
  invalidation) without closing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.internet import defer, reactor
from twisted.internet.protocol import ClientFactory
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from roomstore.replication import ReplicationClientHandler, ReplicationConfig, ReplicationServerFactory
from roomstore.replication import commands as ours
from roomstore.replication.client import ReplicationClientFactory
from roomstore.replication.store_streams import store_stream_registry, wire_server
from tests.db import on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder
from tests.synapse_oracle import prepare_synapse

from .store_utils import ALICE, open_pair, wait_until
from .test_store_streams import populate
from .utils import connect, feed, make_server, seed_registry, take

try:
    prepare_synapse()
    from synapse.replication.tcp import commands as syn
    from synapse.replication.tcp.streams import STREAMS_MAP
except ImportError:  # pragma: no cover - bin/setup installs it
    syn = None

SKIP = None if syn is not None else "matrix-synapse is not installed (bin/setup installs it)"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNAPSE_MAX_LINE = 16384  # Twisted's LineOnlyReceiver.MAX_LENGTH, which Synapse keeps


def synapse_line(cmd) -> str:
    """A line as Synapse's protocol writes it (``send_command``)."""
    return f"{cmd.NAME} {cmd.to_line()}"


def check_with_synapse(test: unittest.TestCase, line: str):
    """Parse ``line`` with Synapse; check it is within the limit, writes back
    byte for byte, and (RDATA) that its row parses. Returns the command and
    the parsed row (or None)."""
    test.assertLessEqual(len(line.encode("utf-8")), SYNAPSE_MAX_LINE, line[:80])
    cmd = syn.parse_command_from_line(line)
    test.assertEqual(synapse_line(cmd).rstrip(" ") if " " not in line else synapse_line(cmd), line)
    row = None
    if isinstance(cmd, syn.RdataCommand):
        row = STREAMS_MAP[cmd.stream_name].parse_row(cmd.row)
    return cmd, row


@on_both_engines
class OurLinesParseWithSynapse:
    skip = SKIP

    async def collect(self, transport: StringTransport, predicate, what: str) -> list[str]:
        lines: list[str] = []

        def ready() -> bool:
            lines.extend(take(transport))
            return predicate(lines)

        await wait_until(ready, 20, what)
        return lines

    async def test_replayed_and_live_rows_parse_with_synapse(self):
        writer, _ = await open_pair(self, workers=())
        history = await populate(writer)
        big_keys = [f"$key{i:05d}:example.org" for i in range(2000)]
        big_token = await writer.invalidate_cache("get_event", big_keys)
        registry = store_stream_registry(writer)
        server = ReplicationServerFactory("hs.example", registry, reactor, ReplicationConfig(page_size=7))
        self.addCleanup(wire_server(writer, server.notify_new_rows))

        # Replayed from token 0 (the legacy REPLICATE a reconnecting worker sends).
        replay, transport = connect(server)
        self.addCleanup(replay.connectionLost, None)
        feed(replay, "NAME w", "REPLICATE events 0", "REPLICATE backfill 0", "REPLICATE caches 0")
        targets = {name: registry.get(name).current_token("master") for name in ("events", "backfill", "caches")}

        def caught_up(lines: list[str]) -> bool:
            done = {
                line.split(" ")[1]
                for line in lines
                if line.startswith("POSITION") and int(line.split(" ")[4]) == targets[line.split(" ")[1]]
            }
            return done == set(targets)

        lines = await self.collect(transport, caught_up, "replay")
        parsed = [check_with_synapse(self, line) for line in lines]
        rows = [(cmd.stream_name, cmd.token, row) for cmd, row in parsed if isinstance(cmd, syn.RdataCommand)]
        self.assertEqual({name for name, _, _ in rows}, {"events", "backfill", "caches"})

        # The events rows carry what the store holds.
        ev = {r.data.event_id: r.data for name, _, r in rows if name == "events" and r.type == "ev"}
        room = history["room"]
        create = ev[room.events[0].event_id]
        self.assertEqual(
            (
                create.room_id,
                create.type,
                create.state_key,
                create.redacts,
                create.relates_to,
                create.membership,
                create.rejected,
                create.outlier,
            ),
            (room.room_id, "m.room.create", "", None, None, None, False, False),
        )
        self.assertEqual(ev[history["redaction"].event_id].redacts, history["message"].event_id)
        self.assertEqual(ev[history["leave"].event_id].membership, "leave")
        state = [r.data for name, _, r in rows if name == "events" and r.type == "state"]
        self.assertIn(
            (room.room_id, "m.room.member", ALICE, room.events[1].event_id),
            [(s.room_id, s.type, s.state_key, s.event_id) for s in state],
        )
        backfill = [r for name, _, r in rows if name == "backfill"]
        self.assertEqual({b.event_id for b in backfill}, {r.event_id for r in history["backfilled"]})
        self.assertEqual({b.room_id for b in backfill}, {"!old:example.org"})

        # The 2,000-key invalidation went out as several rows at one token
        # (all but the last "batch"), together naming every key once.
        big_lines = [
            cmd
            for cmd, row in parsed
            if isinstance(cmd, syn.RdataCommand)
            and cmd.stream_name == "caches"
            and cmd.row[0] == "get_event"
            and cmd.row[1]
            and cmd.row[1][0].startswith("$key")
        ]
        self.assertGreater(len(big_lines), 1)
        self.assertEqual([c.token for c in big_lines], [None] * (len(big_lines) - 1) + [big_token])
        self.assertEqual([k for c in big_lines for k in c.row[1]], big_keys)

        # Live: a connection that asked for everything now gets new rows as
        # they are written, batches and a large invalidation included.
        live, live_transport = connect(server)
        self.addCleanup(live.connectionLost, None)
        feed(live, "NAME w2", "REPLICATE")
        take(live_transport)
        second = UncheckedRoomBuilder("!live:example.org")
        batch = [second.create(), second.join(ALICE), second.join("@bob:example.org"), second.message(ALICE, "hi")]
        results = await writer.persist_events([second.to_persist(e) for e in batch])
        token = await writer.invalidate_cache("get_event", big_keys)
        # Each stream is sent by its own loop: wait for the last line of both.
        ends = (f"RDATA caches master {token} ", f"RDATA events master {results[-1].stream_ordering} ")
        lines = await self.collect(
            live_transport, lambda ls: all(any(line.startswith(end) for line in ls) for end in ends), "live rows"
        )
        parsed = [check_with_synapse(self, line) for line in lines]
        live_rows = [row for cmd, row in parsed if isinstance(cmd, syn.RdataCommand)]
        live_events = {r.data.event_id for r in live_rows if getattr(r, "type", None) == "ev"}
        self.assertEqual(live_events, {e.event_id for e in batch})
        self.assertTrue(any(isinstance(cmd, syn.RdataCommand) and cmd.token is None for cmd, _ in parsed))
        self.assertTrue(live.is_open and replay.is_open)


class OurCommandLinesParseWithSynapse(unittest.TestCase):
    skip = SKIP

    def test_every_command_we_send(self):
        """Every command Synapse knows, as roomstore writes it, parses with
        Synapse's parser and writes back byte for byte; Synapse's reading of
        the fields is roomstore's."""
        commands = [
            ours.ServerCommand("hs.example"),
            ours.NameCommand("worker1"),
            ours.PingCommand("1490197665618"),
            ours.ErrorCommand("failed to parse RDATA: row is not valid JSON"),
            ours.ReplicateCommand(),
            ours.PositionCommand("events", "master", 53, 54),
            ours.RdataCommand("caches", "master", None, ("get_event", ["$a:b"], 1490197670513)),
            ours.UserSyncCommand("worker1", "@alice:example.com", "DEVICE", True, 1490197670513),
            ours.UserSyncCommand("worker1", "@alice:example.com", None, False, 1490197670513),
            ours.ClearUserSyncCommand("worker1"),
            ours.FederationAckCommand("federation_sender", 12345),
            ours.RemoteServerUpCommand("matrix.org"),
            ours.UserIpCommand("@alice:example.com", "syt_tok", "10.0.0.1", "Mozilla/5.0 (X11) \u00e9", None, 17),
            ours.LockReleasedCommand("worker1", "purge_room", "!room:example.com"),
            ours.NewActiveTaskCommand("task1"),
            ours.CancelTaskCommand("task1"),
        ]
        self.assertEqual({c.NAME for c in commands}, set(syn.COMMAND_MAP))
        for cmd in commands:
            line = ours.serialize_command(cmd)
            theirs = syn.parse_command_from_line(line)
            self.assertEqual(type(theirs).NAME, cmd.NAME)
            if cmd.to_line():
                self.assertEqual(synapse_line(theirs), line)
        sync = syn.parse_command_from_line(ours.serialize_command(commands[7]))
        self.assertEqual((sync.user_id, sync.device_id, sync.is_syncing), ("@alice:example.com", "DEVICE", True))
        self.assertIsNone(syn.parse_command_from_line(ours.serialize_command(commands[8])).device_id)
        ip = syn.parse_command_from_line(ours.serialize_command(commands[12]))
        self.assertEqual(
            (ip.access_token, ip.ip, ip.user_agent, ip.device_id, ip.last_seen),
            ("syt_tok", "10.0.0.1", "Mozilla/5.0 (X11) \u00e9", None, 17),
        )


class SynapseLinesTakenWithoutError(unittest.TestCase):
    skip = SKIP

    def synapse_commands(self):
        return {
            "client": [
                syn.NameCommand("synapse.app.generic_worker"),
                syn.PingCommand("1490197665618"),
                syn.ReplicateCommand(),
                syn.UserSyncCommand("worker1", "@alice:example.com", "DEVICE", True, 1490197670513),
                syn.UserSyncCommand("worker1", "@alice:example.com", None, False, 1490197670514),
                syn.ClearUserSyncsCommand("worker1"),
                syn.FederationAckCommand("federation_sender", 12345),
                syn.UserIpCommand("@alice:example.com", "tok", "::1", "curl/8.0 \u00e9", "DEV", 1490197670513),
                syn.UserIpCommand("@alice:example.com", "tok", "::1", "curl", None, 1),
                syn.RemoteServerUpCommand("matrix.org"),
                syn.LockReleasedCommand("worker1", "purge", "!r:example.com"),
                syn.NewActiveTaskCommand("task1"),
                syn.CancelTaskCommand("task1"),
                syn.ErrorCommand("something went wrong"),
            ],
            "server": [
                syn.ServerCommand("hs.example"),
                syn.PingCommand("1490197665618"),
                syn.PositionCommand("events", "master", 0, 0),
                syn.RdataCommand(
                    "events", "master", None, ["state", ["!r:example.com", "m.room.member", ALICE, "$e1"]]
                ),
                syn.RdataCommand(
                    "events",
                    "master",
                    1,
                    ["ev", ["$e1", "!r:example.com", "m.room.member", ALICE, None, None, "join", False, False]],
                ),
                syn.RdataCommand("events", "master", 2, ["state-all", ["!r:example.com"]]),
                syn.RdataCommand(
                    "backfill", "master", 1, ["$e0", "!r:example.com", "m.room.message", None, None, "$parent"]
                ),
                syn.RdataCommand("caches", "master", 1, ["get_event", ["$e1"], 1490197670513]),
                syn.RemoteServerUpCommand("matrix.org"),
                syn.LockReleasedCommand("master", "purge", "!r:example.com"),
                syn.ErrorCommand("something went wrong"),
            ],
        }

    def test_server_takes_synapse_client_lines(self):
        factory = make_server()
        received = []
        for name in (
            "USER_SYNC",
            "CLEAR_USER_SYNC",
            "FEDERATION_ACK",
            "USER_IP",
            "REMOTE_SERVER_UP",
            "LOCK_RELEASED",
            "NEW_ACTIVE_TASK",
            "CANCEL_TASK",
        ):
            factory.add_command_handler(name, lambda conn, cmd: received.append(cmd))
        protocol, transport = connect(factory)
        commands = self.synapse_commands()["client"]
        feed(protocol, *[synapse_line(c) for c in commands])
        out = take(transport)
        self.assertEqual([line for line in out if line.startswith("ERROR")], [])
        self.assertTrue(protocol.is_open)
        self.assertEqual(
            [c.NAME for c in received],
            [
                "USER_SYNC",
                "USER_SYNC",
                "CLEAR_USER_SYNC",
                "FEDERATION_ACK",
                "USER_IP",
                "USER_IP",
                "REMOTE_SERVER_UP",
                "LOCK_RELEASED",
                "NEW_ACTIVE_TASK",
                "CANCEL_TASK",
            ],
        )
        self.assertEqual(
            received[0], ours.UserSyncCommand("worker1", "@alice:example.com", "DEVICE", True, 1490197670513)
        )
        self.assertEqual(
            received[4], ours.UserIpCommand("@alice:example.com", "tok", "::1", "curl/8.0 \u00e9", "DEV", 1490197670513)
        )
        # The REPLICATE was answered with positions.
        self.assertTrue(any(line.startswith("POSITION events master") for line in out))

    def test_client_takes_synapse_server_lines(self):
        class Recorder(ReplicationClientHandler):
            def __init__(self) -> None:
                super().__init__(seed_registry(0))
                self.got: list = []

            def on_rdata(self, stream_name, instance_name, token, rows):
                self.got.append((stream_name, token, rows))

            def on_lock_released(self, instance_name, lock_name, lock_key):
                self.got.append(("lock", instance_name, lock_name, lock_key))

        handler = Recorder()
        factory = ReplicationClientFactory(handler, "worker1", "hs.example", clock=Clock())
        for name in ("events", "backfill", "caches"):
            factory.positions.set(name, "master", 0)
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        take(transport)
        feed(protocol, *[synapse_line(c) for c in self.synapse_commands()["server"]])
        self.assertEqual([line for line in take(transport) if line.startswith("ERROR")], [])
        self.assertTrue(protocol.is_open)
        self.assertEqual(handler.got[0][:2], ("events", 1))
        self.assertEqual([row[0] for row in handler.got[0][2]], ["state", "ev"])
        self.assertEqual(handler.got[1], ("events", 2, [("state-all", ["!r:example.com"])]))
        self.assertEqual(handler.got[-1], ("lock", "master", "purge", "!r:example.com"))


class _SynapseHandler:
    """What Synapse's protocol calls on its ``ReplicationCommandHandler``:
    records what arrives and parses rows with Synapse's stream parsers."""

    def __init__(self) -> None:
        self.connected = defer.Deferred()
        self.lost = False
        self.errors: list[str] = []
        self.positions: dict[str, int] = {}
        self.rows: list = []
        self.parse_failures: list = []

    def new_connection(self, conn) -> None:
        self.conn = conn
        self.connected.callback(conn)

    def lost_connection(self, conn) -> None:
        self.lost = True

    def on_ERROR(self, conn, cmd) -> None:
        self.errors.append(cmd.data)

    def on_POSITION(self, conn, cmd) -> None:
        self.positions[cmd.stream_name] = cmd.new_token

    def on_RDATA(self, conn, cmd) -> None:
        try:
            self.rows.append((cmd.stream_name, cmd.token, STREAMS_MAP[cmd.stream_name].parse_row(cmd.row)))
        except Exception as e:  # recorded, so the test says what failed
            self.parse_failures.append((cmd.stream_name, cmd.row, repr(e)))
        if cmd.token is not None:
            self.positions[cmd.stream_name] = cmd.token


@on_both_engines
class SynapseClientAgainstRoomstoreServer:
    """Synapse's client protocol class against a roomstore server process."""

    skip = SKIP

    async def test_synapse_client_receives_live_rows(self):
        from synapse.replication.tcp.protocol import ClientReplicationStreamProtocol
        from synapse.util.clock import Clock as SynapseClock

        url = self.new_database_url()
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.replication.interop_server", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=REPO),
            cwd=REPO,
        )
        self.addCleanup(server.wait, 30)
        self.addCleanup(server.stdin.close)
        port = json.loads(await self.read_line(server))["port"]

        handler = _SynapseHandler()

        class HomeServer:  # what the protocol asks of its hs: nothing our handler needs
            def run_as_background_process(self, desc, func, *args):
                return defer.ensureDeferred(func(*args))

        class Factory(ClientFactory):
            def buildProtocol(self, addr):
                return ClientReplicationStreamProtocol(
                    HomeServer(),
                    "synapse-worker",
                    "hs.example",
                    SynapseClock(reactor, server_name="hs.example"),
                    handler,
                )

        connector = reactor.connectTCP("127.0.0.1", port, Factory())
        self.addCleanup(connector.disconnect)
        await handler.connected
        await wait_until(lambda: set(handler.positions) >= {"events", "backfill", "caches"}, 20, "positions")

        for request in ("events 130", "invalidate 3000", "events 60"):
            server.stdin.write(request.encode() + b"\n")
            server.stdin.flush()
            done = json.loads(await self.read_line(server))
        targets = done["positions"]
        await wait_until(
            lambda: (
                handler.positions.get("events") == targets["events"]
                and handler.positions.get("caches") == targets["caches"]
            ),
            30,
            "live rows at the writer's positions",
        )
        self.assertEqual(handler.parse_failures, [])
        self.assertEqual(handler.errors, [])
        self.assertFalse(handler.lost)
        self.assertEqual(handler.conn.state, "established")
        events = [row for name, _, row in handler.rows if name == "events" and row.type == "ev"]
        self.assertEqual(len(events), 190)
        invalidated = [
            k
            for name, _, row in handler.rows
            if name == "caches" and row.cache_func == "get_event" and row.keys
            for k in row.keys
            if k.startswith("$key")
        ]
        self.assertEqual(len(invalidated), 3000)

    async def read_line(self, process: subprocess.Popen) -> bytes:
        """One stdout line of ``process``, read in a thread (the reactor keeps running)."""
        from twisted.internet import threads

        line = await threads.deferToThread(process.stdout.readline)
        if not line:
            raise AssertionError(f"server process ended ({process.poll()})")
        return line
