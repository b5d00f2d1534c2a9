"""Parsing and writing replication commands."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from roomstore.replication import commands as c
from roomstore.replication.commands import (
    COMMAND_TYPES,
    MAX_LINE_LENGTH,
    CommandParseError,
    UnknownCommandError,
    parse_command_from_line,
    serialize_command,
)

#: One example line per command and form, exactly as it must appear on the wire.
EXAMPLE_LINES = [
    "SERVER localhost:8823",
    "NAME synapse.app.appservice",
    "PING 1490197665618",
    "PING",
    "ERROR server stopping",
    "ERROR",
    "REPLICATE",
    "REPLICATE events 53",
    "REPLICATE ALL NOW",
    "POSITION events master 53 54",
    'RDATA caches master 2 ["get_user_by_id",["@01register-user:localhost:8823"],1490197670513]',
    'RDATA caches master batch ["get_user_by_id",["@test:localhost:8823"],1490197670513]',
    'RDATA events master 14 ["ev",["$149019767112vOHxz:localhost:8823","!AFDCvgApUmpdfVjIXm:localhost:8823","m.room.guest_access","",null,null,null,false,false]]',  # noqa: E501 (a wire line, verbatim)
    'RDATA events master batch ["state",["!AFDCvgApUmpdfVjIXm:localhost:8823","m.room.guest_access","","$149019767112vOHxz:localhost:8823"]]',  # noqa: E501 (a wire line, verbatim)
    'RDATA backfill master 3 ["$e:localhost:8823","!r:localhost:8823","m.room.message",null,null,null]',
    "USER_SYNC worker1 @alice:example.com DEVICEID start 1490197670513",
    "USER_SYNC worker1 @alice:example.com None end 1490197670513",
    "CLEAR_USER_SYNC worker1",
    "FEDERATION_ACK federation_sender 12345",
    "REMOTE_SERVER_UP matrix.org",
    "AUTH s3cret with spaces",
    'USER_IP @alice:example.com ["syt_token","127.0.0.1","Mozilla/5.0 (X11; Linux)","DEVICEID",1490197670513]',
    'USER_IP @alice:example.com ["syt_token","::1","curl",null,1]',
    'LOCK_RELEASED ["worker1","purge","!room:example.com"]',
    'NEW_ACTIVE_TASK "task_id"',
    'CANCEL_TASK "task_id"',
]


class RoundTripTests(unittest.TestCase):
    def test_every_command_has_an_example(self) -> None:
        """The examples cover every registered command."""
        names = {line.split(" ", 1)[0] for line in EXAMPLE_LINES}
        self.assertEqual(names, set(COMMAND_TYPES))

    def test_examples_round_trip_exactly(self) -> None:
        """parse then serialize gives back the identical line, and
        from_line(to_line()) gives back an equal command."""
        for line in EXAMPLE_LINES:
            cmd = parse_command_from_line(line)
            self.assertIsInstance(cmd, COMMAND_TYPES[line.split(" ", 1)[0]])
            self.assertEqual(serialize_command(cmd), line)
            self.assertEqual(type(cmd).from_line(cmd.to_line()), cmd)

    def test_parsed_fields(self) -> None:
        rdata = parse_command_from_line('RDATA caches master batch [1, {"b": 2, "a": null}]')
        self.assertEqual(
            (rdata.stream_name, rdata.instance_name, rdata.token, rdata.row),
            ("caches", "master", None, [1, {"a": None, "b": 2}]),
        )
        self.assertTrue(rdata.is_batch)
        # A parsed row keeps its text as received, so a relayed line is
        # byte for byte what came in; a built row is written compact, keys
        # sorted, non-ASCII escaped.
        self.assertEqual(rdata.row_json, '[1, {"b": 2, "a": null}]')
        self.assertEqual(c.RdataCommand("s", "w", 3, [1, {"b": 2, "a": None}]).row_json, '[1,{"a":null,"b":2}]')
        self.assertEqual(rdata, c.RdataCommand("caches", "master", None, [1, {"b": 2, "a": None}]))
        self.assertEqual(c.RdataCommand("s", "w", 3, ("é", "a b")).to_line(), 's w 3 ["\\u00e9","a b"]')

        position = parse_command_from_line("POSITION events master 53 54")
        self.assertEqual(position, c.PositionCommand("events", "master", 53, 54))

        self.assertEqual(parse_command_from_line("REPLICATE"), c.ReplicateCommand())
        self.assertFalse(c.ReplicateCommand().is_legacy)
        legacy = parse_command_from_line("REPLICATE events 53")
        self.assertEqual((legacy.stream_name, legacy.token, legacy.is_legacy), ("events", 53, True))
        self.assertEqual(parse_command_from_line("REPLICATE caches now"), c.ReplicateCommand("caches", None))

        self.assertEqual(parse_command_from_line("ERROR a  b ").message, "a  b ")
        self.assertEqual(parse_command_from_line("SERVER localhost:8823").server_name, "localhost:8823")

    def test_user_sync_states(self) -> None:
        """start/end as Synapse writes them; "stop" accepted as an alias of end."""
        self.assertTrue(parse_command_from_line("USER_SYNC w @a:b D start 5").is_syncing)
        end = parse_command_from_line("USER_SYNC w @a:b D end 5")
        stop = parse_command_from_line("USER_SYNC w @a:b D stop 5")
        self.assertFalse(end.is_syncing)
        self.assertEqual(stop, end)
        self.assertEqual(serialize_command(stop), "USER_SYNC w @a:b D end 5")

    def test_user_sync_device(self) -> None:
        """Synapse's five fields (device "None" for none); the older four-field
        form is read with no device and written in the five-field form."""
        with_device = parse_command_from_line("USER_SYNC w @a:b DEV start 5")
        self.assertEqual(with_device, c.UserSyncCommand("w", "@a:b", "DEV", True, 5))
        none = parse_command_from_line("USER_SYNC w @a:b None end 5")
        self.assertEqual(none, c.UserSyncCommand("w", "@a:b", None, False, 5))
        old = parse_command_from_line("USER_SYNC w @a:b start 5")
        self.assertEqual(old, c.UserSyncCommand("w", "@a:b", None, True, 5))
        self.assertEqual(serialize_command(old), "USER_SYNC w @a:b None start 5")

    def test_user_ip_and_lock_released_fields(self) -> None:
        ip = parse_command_from_line('USER_IP @a:b ["tok","10.0.0.1","UA \\u00e9",null,7]')
        self.assertEqual(ip, c.UserIpCommand("@a:b", "tok", "10.0.0.1", "UA \u00e9", None, 7))
        self.assertNotIn("tok", repr(ip))
        lock = parse_command_from_line('LOCK_RELEASED ["w1","name","key with spaces"]')
        self.assertEqual(lock, c.LockReleasedCommand("w1", "name", "key with spaces"))

    def test_rdata_equality_ignores_tuple_versus_list(self) -> None:
        """A command built from a tuple row equals the one parsed off the wire."""
        cmd = c.RdataCommand("events", "master", 7, ("$e", None, 3))
        self.assertEqual(parse_command_from_line(serialize_command(cmd)), cmd)


# Hypothesis strategies for valid field values.
_word_chars = string.ascii_letters + string.digits + "!$@:._-=/\u00e9\u4e2d"
words = st.text(alphabet=_word_chars, min_size=1, max_size=20)
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=40)
#: NAME and SERVER: no control characters (40 characters stay under the 255-byte bound).
peer_names = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)
tokens = st.integers(min_value=0, max_value=2**63 - 1)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)

any_command = st.one_of(
    st.builds(c.ServerCommand, peer_names),
    st.builds(c.NameCommand, peer_names),
    st.builds(c.PingCommand, texts),
    st.builds(c.ErrorCommand, texts),
    st.just(c.ReplicateCommand()),
    st.builds(c.ReplicateCommand, words, st.none() | tokens),
    st.builds(c.PositionCommand, words, words, tokens, tokens),
    st.builds(c.RdataCommand, words, words, st.none() | tokens, st.lists(json_values, max_size=5)),
    st.builds(c.UserSyncCommand, words, words, st.none() | words.filter(lambda w: w != "None"), st.booleans(), tokens),
    st.builds(c.UserIpCommand, words, texts, texts, texts, st.none() | texts, tokens),
    st.builds(c.LockReleasedCommand, texts, texts, texts),
    st.builds(c.NewActiveTaskCommand, texts.filter(bool)),
    st.builds(c.CancelTaskCommand, texts.filter(bool)),
    st.builds(c.ClearUserSyncCommand, words),
    st.builds(c.FederationAckCommand, words, tokens),
    st.builds(c.RemoteServerUpCommand, words),
)


class PropertyTests(unittest.TestCase):
    @settings(max_examples=500, deadline=None, database=None)
    @given(any_command)
    def test_any_command_round_trips(self, cmd: c.Command) -> None:
        line = serialize_command(cmd)
        self.assertNotIn("\n", line)
        parsed = parse_command_from_line(line)
        self.assertEqual(parsed, cmd)
        self.assertEqual(serialize_command(parsed), line)

    @settings(max_examples=1000, deadline=None, database=None)
    @given(
        st.text(max_size=60)
        | st.sampled_from(list(COMMAND_TYPES)).flatmap(
            lambda name: st.text(max_size=40).map(lambda rest: f"{name} {rest}")
        )
    )
    def test_parse_raises_only_parse_errors(self, line: str) -> None:
        """Whatever the input, the parser returns a command or raises
        CommandParseError; anything it returns can be written back."""
        try:
            cmd = parse_command_from_line(line)
        except CommandParseError as e:
            self.assertNotIn("\n", e.reason)
            return
        parse_command_from_line(serialize_command(cmd))


class ParseErrorTests(unittest.TestCase):
    def assertParseError(self, line: str, fragment: str) -> CommandParseError:
        with self.assertRaises(CommandParseError) as cm:
            parse_command_from_line(line)
        self.assertIn(fragment, cm.exception.reason)
        return cm.exception

    def test_unknown_command_has_its_own_type(self) -> None:
        error = self.assertParseError("FROBNICATE now", "unknown command 'FROBNICATE'")
        self.assertIsInstance(error, UnknownCommandError)
        self.assertEqual(error.command_name, "FROBNICATE")
        # Names are case-sensitive.
        self.assertIsInstance(self.assertParseError("ping 1", "unknown"), UnknownCommandError)

    def test_malformed_lines_give_specific_reasons(self) -> None:
        cases = [
            ("", "empty line"),
            ("PING a\rb", "line break"),
            ("SERVER", "must not be empty"),
            ("NAME ", "must not be empty"),
            ("NAME " + "w" * 10_000 + "\x00", "must not contain control characters"),
            ("NAME " + "w" * 256, "longer than 255 bytes"),
            ("SERVER hs\x01", "must not contain control characters"),
            ("REPLICATE events", "<stream_name> <token>"),
            ("REPLICATE events 1 2", "<stream_name> <token>"),
            ("REPLICATE events -1", "token must be a non-negative integer"),
            ("REPLICATE events 1e3", "token must be a non-negative integer"),
            ("REPLICATE events " + "9" * 21, "token must be a non-negative integer"),
            ("POSITION events master 1", "<prev_token> <new_token>"),
            ("POSITION events master x 1", "prev_token must be"),
            ("POSITION events  master 1 1", "<stream_name> <instance_name>"),
            ("RDATA events master 1", "<row_json>"),
            ("RDATA events master one [1]", "token must be"),
            ("RDATA events master 1 [1,", "row is not valid JSON"),
            ("RDATA events master 1 NaN", "row is not valid JSON"),
            ("RDATA events master 1 [1e999]", "not JSON-serialisable"),
            ("RDATA events master 1 " + "[" * 100_000, "row is not valid JSON"),
            ("USER_SYNC w @a:b maybe 1", "USER_SYNC state must be start or end"),
            ("USER_SYNC w @a:b D maybe 1", "USER_SYNC state must be start or end"),
            ("USER_SYNC w @a:b start", "<last_sync_ms>"),
            ("USER_SYNC w @a:b D start 1 2", "<last_sync_ms>"),
            ("USER_IP @a:b", "<user_id> [access_token"),
            ("USER_IP @a:b [1,2]", "<user_id> [access_token"),
            ('USER_IP @a:b ["t","ip","ua",null,-1]', "last_seen must not be negative"),
            ('USER_IP @a:b ["t","ip","ua",null,1', "not valid JSON"),
            ('LOCK_RELEASED ["a","b"]', "<lock_key>"),
            ('LOCK_RELEASED ["a","b",3]', "lock_key must be a str"),
            ("RDATA ev\tents master 1 [1]", "stream_name must be"),
            ("RDATA events master\x00 1 [1]", "instance_name must be"),
            ("CLEAR_USER_SYNC", "<argument>"),
            ("CLEAR_USER_SYNC a b", "<argument>"),
            ("FEDERATION_ACK fed", "<instance_name> <token>"),
            ("REMOTE_SERVER_UP", "<argument>"),
        ]
        for line, fragment in cases:
            error = self.assertParseError(line, fragment)
            self.assertFalse(isinstance(error, UnknownCommandError), line)

    def test_constructors_validate(self) -> None:
        """Bad values fail where they enter, not when written."""
        with self.assertRaises(ValueError):
            c.PositionCommand("has space", "master", 1, 1)
        with self.assertRaises(ValueError):
            c.PositionCommand("events", "master", -1, 1)
        with self.assertRaises(TypeError):
            c.PositionCommand("events", "master", True, 1)
        with self.assertRaises(ValueError):
            c.ErrorCommand("two\nlines")
        with self.assertRaises(ValueError):
            c.ErrorCommand("lone \ud800 surrogate")
        with self.assertRaises(ValueError):
            c.RdataCommand("events", "master", 1, {1, 2})
        with self.assertRaises(ValueError):
            c.ReplicateCommand(None, 5)

    def test_max_line_length(self) -> None:
        """Synapse's limit (Twisted's LineOnlyReceiver default): a longer line
        closes a Synapse connection."""
        self.assertEqual(MAX_LINE_LENGTH, 16384)
