"""Throw a large number of random and mutated lines at a server protocol.

Seeded, so a failure reproduces; bounded, so it runs in seconds. For every
line the test works out on its own what the server must do (ignore it, answer
ERROR, or accept it) and checks the protocol did exactly that without raising.
"""

from __future__ import annotations

import random
import time

from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from roomstore.replication import InMemoryStream, StreamRegistry
from roomstore.replication.commands import (
    CLIENT_SENT_COMMANDS,
    COMMAND_TYPES,
    CommandParseError,
    RdataCommand,
    parse_command_from_line,
    parse_rdata_fields,
)

from .test_commands import EXAMPLE_LINES
from .utils import make_server

LINES = 100_000
MAX_LINE = 1024
SEED = 20170322

CLIENT_LINES = [
    "NAME synapse.app.generic_worker",
    "PING 1490197665618",
    "REPLICATE",
    "REPLICATE events 3",
    "REPLICATE caches NOW",
    "REPLICATE ALL 0",
    "REPLICATE backfill 10",
    "ERROR client is sad",
    "USER_SYNC worker1 @alice:example.com start 1490197670513",
    "USER_SYNC worker1 @alice:example.com end 1",
    "CLEAR_USER_SYNC worker1",
    "FEDERATION_ACK federation_sender 7",
    "REMOTE_SERVER_UP matrix.org",
]
SEEDS = CLIENT_LINES * 3 + EXAMPLE_LINES

FRAGMENTS = [
    *COMMAND_TYPES,
    "events",
    "caches",
    "backfill",
    "typing",
    "ALL",
    "NOW",
    "now",
    "batch",
    "master",
    "0",
    "1",
    "-1",
    "007",
    "99999999999999999999",
    "999999999999999999999",
    "1e3",
    "0x10",
    "[]",
    "[1,2",
    "{}",
    '{"a":',
    "null",
    "NaN",
    "Infinity",
    "[1e999]",
    '"\\ud800"',
    "[" * 50,
    "start",
    "end",
    "stop",
    "",
    " ",
    "\t",
    "\r",
    "\x00",
    "\u2028",
    "\u00e9",
    "\U0001f600",
]

BYTE_ALPHABET = (
    [bytes([b]) for b in range(0x20, 0x7F)] * 4
    + [b" "] * 40
    + [b"\r", b"\t", b"\x00", b"\x0b", b"\xff", b"\xc3", b"\xa9", b"\xe2\x80\xa8", b"\xed\xa0\x80", b"\xf0\x9f\x98\x80"]
)


def _random_bytes(rng: random.Random) -> bytes:
    return b"".join(rng.choice(BYTE_ALPHABET) for _ in range(rng.randrange(0, 60)))


def _random_words(rng: random.Random) -> bytes:
    words = [rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 7))]
    return " ".join(words).encode("utf-8", "surrogatepass")


def _mutate(rng: random.Random, line: bytes) -> bytes:
    data = bytearray(line)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(9)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # delete a byte
            del data[min(pos, len(data) - 1)]
        elif op == 1:  # insert a byte
            data[pos:pos] = rng.choice(BYTE_ALPHABET)
        elif op == 2 and data:  # replace a byte
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 3:  # truncate
            del data[pos:]
        elif op == 4:  # swap two words
            words = bytes(data).split(b" ")
            if len(words) > 1:
                i, j = rng.randrange(len(words)), rng.randrange(len(words))
                words[i], words[j] = words[j], words[i]
                data = bytearray(b" ".join(words))
        elif op == 5:  # replace a word with a fragment
            words = bytes(data).split(b" ")
            words[rng.randrange(len(words))] = rng.choice(FRAGMENTS).encode("utf-8", "surrogatepass")
            data = bytearray(b" ".join(words))
        elif op == 6:  # double spaces, trailing space
            data = bytearray(bytes(data).replace(b" ", b"  ", 1) if rng.random() < 0.5 else bytes(data) + b" ")
        elif op == 7:  # change the case of the command name
            data = bytearray(bytes(data).lower() if rng.random() < 0.5 else bytes(data).upper())
        else:  # duplicate a chunk
            chunk = bytes(data[pos : pos + rng.randrange(1, 20)])
            data[pos:pos] = chunk
    return bytes(data)


def make_line(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.10:
        line = rng.choice(SEEDS).encode("utf-8")
    elif kind < 0.55:
        line = _mutate(rng, rng.choice(SEEDS).encode("utf-8"))
    elif kind < 0.75:
        line = _random_words(rng)
    elif kind < 0.995:
        line = _random_bytes(rng)
    else:  # over-long
        line = rng.choice(SEEDS).encode("utf-8") + b"x" * rng.randrange(MAX_LINE, 3 * MAX_LINE)
    return line.replace(b"\n", b"")


class Oracle:
    """Decides, independently of the protocol's code paths, what a server
    must do with a line."""

    def __init__(self, registry: StreamRegistry) -> None:
        self.registry = registry

    def __call__(self, raw: bytes) -> str:
        if len(raw) > MAX_LINE:
            return "too_long"
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "error"
        if not text.strip():
            return "blank"
        if text.partition(" ")[0] not in COMMAND_TYPES:
            return "error"
        try:
            cmd = parse_command_from_line(text)
        except CommandParseError:
            return "error"
        if cmd.NAME not in CLIENT_SENT_COMMANDS:
            return "error"
        if cmd.NAME == "REPLICATE" and cmd.stream_name not in (None, "ALL") and cmd.stream_name not in self.registry:
            return "error"
        return "ok"


class FuzzTests(unittest.TestCase):
    def test_random_and_mutated_lines(self) -> None:
        registry = StreamRegistry()
        for name in ("events", "backfill", "caches"):
            stream = InMemoryStream(name, writers=["master", "worker2"])
            for token in range(1, 16):
                stream.append("master", token, *[[name, token, i] for i in range(1 + token % 3)])
            registry.register(stream)
        factory = make_server(registry, max_line_length=MAX_LINE)
        notifications = []
        for name in ("USER_SYNC", "CLEAR_USER_SYNC", "FEDERATION_ACK", "REMOTE_SERVER_UP"):
            factory.add_command_handler(name, lambda conn, cmd: notifications.append(cmd.NAME))
        oracle = Oracle(registry)
        rng = random.Random(SEED)

        def new_connection():
            protocol = factory.buildProtocol(None)
            transport = StringTransport()
            protocol.makeConnection(transport)
            transport.clear()
            return protocol, transport

        protocol, transport = new_connection()
        outcomes = {"ok": 0, "error": 0, "blank": 0, "too_long": 0}
        started = time.monotonic()
        for i in range(LINES):
            line = make_line(rng)
            expected = oracle(line)
            outcomes[expected] += 1
            protocol.dataReceived(line + b"\n")  # must never raise
            out = transport.value().split(b"\n")[:-1]
            transport.clear()
            context = f"line {i}: {line[:120]!r} -> {out[:3]!r}"
            if expected == "blank":
                self.assertEqual(out, [], context)
            elif expected == "error":
                self.assertEqual(len(out), 1, context)
                self.assertTrue(out[0].startswith(b"ERROR "), context)
                self.assertTrue(protocol.is_open, context)
            elif expected == "ok":
                self.assertFalse(any(o.startswith(b"ERROR") for o in out), context)
                self.assertTrue(protocol.is_open, context)
            else:
                self.assertEqual(out, [b"ERROR line too long"], context)
                self.assertFalse(protocol.is_open, context)
                protocol.connectionLost(None)
                protocol, transport = new_connection()
        elapsed = time.monotonic() - started

        # The generator really did produce a mix, mostly bad lines.
        self.assertEqual(sum(outcomes.values()), LINES)
        self.assertGreater(outcomes["error"], LINES // 2)
        self.assertGreater(outcomes["ok"], 1000)
        self.assertGreater(outcomes["blank"], 10)
        self.assertGreater(outcomes["too_long"], 100)
        self.assertTrue(notifications)
        # Every connection but the last was closed for a too-long line only.
        self.assertEqual(len(factory.connections), 1)
        self.assertLess(elapsed, 60, f"fuzzing took {elapsed:.1f}s")

    def test_rdata_fields_agree_with_the_parser(self) -> None:
        """``parse_rdata_fields`` (a worker's fast path, no command built)
        gives exactly the fields of the RdataCommand ``parse_command_from_line``
        makes of a line, and None for every line it would not make one of
        (other commands, and bad RDATA lines, which the parser then reports)."""
        rng = random.Random(SEED + 1)
        rdata_seeds = [line for line in SEEDS if line.startswith("RDATA ")]
        outcomes = {"rdata": 0, "other": 0, "error": 0}
        for i in range(LINES // 4):
            raw = _mutate(rng, rng.choice(rdata_seeds).encode()) if i % 2 else make_line(rng)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            try:
                cmd = parse_command_from_line(text)
            except CommandParseError:
                cmd = None
            fields = parse_rdata_fields(text)
            if isinstance(cmd, RdataCommand):
                outcomes["rdata"] += 1
                self.assertEqual(fields, (cmd.stream_name, cmd.instance_name, cmd.token, cmd.row), repr(raw))
                self.assertEqual(type(fields[3]), type(cmd.row), repr(raw))
            else:
                outcomes["other" if cmd is not None else "error"] += 1
                self.assertIsNone(fields, repr(raw))
        self.assertGreater(outcomes["rdata"], 1000)
        self.assertGreater(outcomes["error"], 1000)
        self.assertGreater(outcomes["other"], 100)
