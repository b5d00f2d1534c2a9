"""The commands of the TCP replication protocol, as values.

A line on the wire is ``<NAME>`` or ``<NAME> <args>``, UTF-8, terminated by
``\\n`` (the protocol strips the terminator before anything here sees it).
Each command is a frozen attrs class that owns the format of its ``<args>``:

- ``Cmd.from_line(args)`` parses the part after the command name and either
  returns a command or raises :class:`CommandParseError`.
- ``cmd.to_line()`` returns that same part, so ``Cmd.from_line(cmd.to_line())``
  equals ``cmd``. :func:`serialize_command` prefixes the name to give a line.
- :func:`parse_command_from_line` parses a whole line through
  :data:`COMMAND_TYPES`; an unknown name raises :class:`UnknownCommandError`.

Validation happens at construction (attrs validators), so a command that
exists can always be written: names contain no whitespace, free text contains
no line break, tokens are non-negative integers and RDATA rows are
JSON-serialisable. Nothing here does I/O or logging.

Parsing checks the same things without running the validators (the parse is
the hot path of a worker): a line that parses gives a command the validators
would accept. An RDATA command parsed off the wire keeps the row's JSON text
as received, so writing it again gives back the same bytes without
re-encoding; a command built in code encodes its row once, at construction.

Rows are written as compact JSON with sorted keys and ASCII escapes
(``separators=(",", ":"), sort_keys=True``): deterministic, and an encoded row
can never contain a line break, whatever strings it holds. Synapse writes
compact ASCII JSON too, so for the rows the store sends (arrays of strings,
numbers, booleans and nulls) the bytes are the same as Synapse's.

Wire formats follow matrix-synapse 1.163's ``synapse.replication.tcp.commands``
(checked against the installed package by ``tests/replication/test_interop.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import attrs

from roomstore.replication.wire import (
    _MAX_KNOWN_WORDS,
    _MAX_TOKEN_DIGITS,
    MAX_LINE_LENGTH,
    CommandParseError,
    UnknownCommandError,
    _check_json_string,
    _check_nonempty,
    _check_optional_text,
    _check_optional_token,
    _check_peer_name,
    _check_text,
    _check_token,
    _check_word,
    _check_writable,
    _json_list,
    _known_words,
    _parse_token,
    _parse_word,
    _scan_once,
    _split_words,
    decode_row,
    describe,
    encode_row,
)

__all__ = [
    "AuthCommand",
    "CLIENT_NOTIFICATIONS",
    "CLIENT_SENT_COMMANDS",
    "CancelTaskCommand",
    "COMMAND_TYPES",
    "MAX_LINE_LENGTH",
    "SERVER_SENT_COMMANDS",
    "ClearUserSyncCommand",
    "Command",
    "CommandParseError",
    "ErrorCommand",
    "FederationAckCommand",
    "LockReleasedCommand",
    "NameCommand",
    "NewActiveTaskCommand",
    "PingCommand",
    "PositionCommand",
    "RdataCommand",
    "RemoteServerUpCommand",
    "ReplicateCommand",
    "ServerCommand",
    "UnknownCommandError",
    "UserIpCommand",
    "UserSyncCommand",
    "decode_row",
    "describe",
    "encode_row",
    "parse_command_from_line",
    "parse_rdata_fields",
    "serialize_command",
]

_C = TypeVar("_C", bound="Command")


def _construct(cls: type[_C], *args: Any) -> _C:
    """Build a command from parsed fields, turning validation errors into
    CommandParseError so from_line only ever raises that."""
    try:
        return cls(*args)
    except (TypeError, ValueError) as e:
        raise CommandParseError(f"invalid {cls.NAME}: {e}") from None


# ---------------------------------------------------------------------------


class Command(abc.ABC):
    """A replication command. Subclasses are frozen attrs classes.

    ``NAME`` is the first word of the line. ``from_line`` parses the rest of
    the line (without the name and the separating space) and raises only
    :class:`CommandParseError`; ``to_line`` is its inverse.
    """

    NAME: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def from_line(cls: type[_C], args: str) -> _C:
        """Parse the part of a line after the command name."""

    @abc.abstractmethod
    def to_line(self) -> str:
        """Return the part of the line after the command name ("" if none)."""


class _TextCommand(Command):
    """A command whose whole argument is one piece of free text."""

    @classmethod
    def from_line(cls, args: str):
        return _construct(cls, args)

    def to_line(self) -> str:
        return self.text  # type: ignore[attr-defined]


@attrs.frozen
class ServerCommand(_TextCommand):
    """``SERVER <server_name>``: sent by the server on connect, naming itself."""

    NAME: ClassVar[str] = "SERVER"
    text: str = attrs.field(validator=[_check_text, _check_nonempty, _check_peer_name])

    @property
    def server_name(self) -> str:
        return self.text


@attrs.frozen
class NameCommand(_TextCommand):
    """``NAME <client_name>``: sent by the client on connect, naming itself."""

    NAME: ClassVar[str] = "NAME"
    text: str = attrs.field(validator=[_check_text, _check_nonempty, _check_peer_name])

    @property
    def client_name(self) -> str:
        return self.text


@attrs.frozen
class PingCommand(_TextCommand):
    """``PING <data>``: keep-alive. ``data`` is opaque (we send a timestamp in
    milliseconds) and may be empty."""

    NAME: ClassVar[str] = "PING"
    text: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class ErrorCommand(_TextCommand):
    """``ERROR <message>``: the sender hit an error; it may close next."""

    NAME: ClassVar[str] = "ERROR"
    text: str = attrs.field(default="", validator=_check_text)

    @property
    def message(self) -> str:
        return self.text


@attrs.frozen
class AuthCommand(_TextCommand):
    """``AUTH <secret>``: sent by a client as its first command when the
    server requires a shared secret (not part of Synapse's protocol).

    The secret is free text (no line break) and is left out of ``repr`` so it
    never reaches a log line.
    """

    NAME: ClassVar[str] = "AUTH"
    text: str = attrs.field(repr=False, validator=[_check_text, _check_nonempty])

    @property
    def secret(self) -> str:
        return self.text


@attrs.frozen
class NewActiveTaskCommand(_TextCommand):
    """``NEW_ACTIVE_TASK <task_id>``: a background task is ready to run.
    Synapse sends it over Redis only; accepted here so such a line is never
    an error."""

    NAME: ClassVar[str] = "NEW_ACTIVE_TASK"
    text: str = attrs.field(validator=[_check_text, _check_nonempty])

    @property
    def task_id(self) -> str:
        return self.text


@attrs.frozen
class CancelTaskCommand(_TextCommand):
    """``CANCEL_TASK <task_id>``: a background task was cancelled (Synapse
    sends it over Redis only, as NEW_ACTIVE_TASK)."""

    NAME: ClassVar[str] = "CANCEL_TASK"
    text: str = attrs.field(validator=[_check_text, _check_nonempty])

    @property
    def task_id(self) -> str:
        return self.text


@attrs.frozen
class ReplicateCommand(Command):
    """``REPLICATE`` or, in the legacy form, ``REPLICATE <stream_name> <token>``.

    The bare form (``stream_name is None``) asks for the current position of
    every stream. The legacy form asks the server to replay ``stream_name``
    from after ``token``; ``token is None`` stands for the legacy ``NOW``
    (no replay, just the position). The server also accepts the legacy
    stream name ``ALL``.
    """

    NAME: ClassVar[str] = "REPLICATE"
    stream_name: str | None = attrs.field(default=None)
    token: int | None = attrs.field(default=None, validator=_check_optional_token)

    @stream_name.validator
    def _check_stream_name(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None:
            _check_word(self, attribute, value)

    def __attrs_post_init__(self) -> None:
        if self.stream_name is None and self.token is not None:
            raise ValueError("a REPLICATE token needs a stream name")

    @property
    def is_legacy(self) -> bool:
        return self.stream_name is not None

    @classmethod
    def from_line(cls, args: str) -> ReplicateCommand:
        if args == "":
            return cls()
        stream_name, token_text = _split_words(args, 2, "nothing or <stream_name> <token>")
        if token_text in ("NOW", "now"):
            return _construct(cls, stream_name, None)
        return _construct(cls, stream_name, _parse_token(token_text, "token"))

    def to_line(self) -> str:
        if self.stream_name is None:
            return ""
        token = "NOW" if self.token is None else str(self.token)
        return f"{self.stream_name} {token}"


@attrs.frozen
class PositionCommand(Command):
    """``POSITION <stream_name> <instance_name> <prev_token> <new_token>``.

    Sent by the server: ``instance_name``'s position in ``stream_name`` moved
    from ``prev_token`` (the last position this connection was told) to
    ``new_token`` with no rows in between. A client behind ``prev_token``
    has missed rows and must fetch them itself.
    """

    NAME: ClassVar[str] = "POSITION"
    stream_name: str = attrs.field(validator=_check_word)
    instance_name: str = attrs.field(validator=_check_word)
    prev_token: int = attrs.field(validator=_check_token)
    new_token: int = attrs.field(validator=_check_token)

    @classmethod
    def from_line(cls, args: str) -> PositionCommand:
        stream_name, instance_name, prev, new = _split_words(
            args, 4, "<stream_name> <instance_name> <prev_token> <new_token>"
        )
        return _construct(
            cls,
            stream_name,
            instance_name,
            _parse_token(prev, "prev_token"),
            _parse_token(new, "new_token"),
        )

    def to_line(self) -> str:
        return f"{self.stream_name} {self.instance_name} {self.prev_token} {self.new_token}"


_new = object.__new__
_set = object.__setattr__


@attrs.frozen(eq=False)
class RdataCommand(Command):
    """``RDATA <stream_name> <instance_name> <token|batch> <row_json>``.

    One row of a stream. When several rows share a token, all but the last
    carry ``batch`` (``token is None``) and the receiver applies them only
    when the line with the numeric token arrives. ``row_json`` may contain
    spaces (it is the rest of the line) but never a line break.

    Built in code, the row is encoded at construction (which is where a
    non-serialisable row fails); parsed off the wire, ``row_json`` is the text
    as received. Equality compares the rows' canonical encodings, so a command
    built from a tuple equals the same command parsed back from the wire,
    where arrays come back as lists.
    """

    NAME: ClassVar[str] = "RDATA"
    stream_name: str = attrs.field(validator=_check_word)
    instance_name: str = attrs.field(validator=_check_word)
    token: int | None = attrs.field(validator=_check_optional_token)
    row: Any = attrs.field()
    row_json: str = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _set(self, "row_json", encode_row(self.row))

    @property
    def is_batch(self) -> bool:
        return self.token is None

    @classmethod
    def from_line(cls, args: str) -> RdataCommand:
        parts = args.split(" ", 3)
        if len(parts) != 4:
            raise CommandParseError(f"expected <stream_name> <instance_name> <token> <row_json>, got {describe(args)}")
        return _rdata(*parts)

    @classmethod
    def from_encoded(
        cls, stream_name: str, instance_name: str, token: int | None, row: Any, row_json: str
    ) -> RdataCommand:
        """A command for ``row`` already encoded as ``row_json`` (which must be
        ``encode_row(row)``): what a server builds for every row it sends,
        without encoding twice. Names and token are checked as by the
        constructor (names seen before with a set lookup)."""
        if stream_name not in _known_words or instance_name not in _known_words:
            # The validators' exceptions (ValueError/TypeError), as the
            # constructor raises them.
            _check_word(None, _RDATA_FIELDS.stream_name, stream_name)
            _check_word(None, _RDATA_FIELDS.instance_name, instance_name)
            if len(_known_words) < _MAX_KNOWN_WORDS:
                _known_words.update((stream_name, instance_name))
        if token is not None and (type(token) is not int or token < 0):
            _check_token(None, _RDATA_FIELDS.token, token)
        return _checked_rdata(stream_name, instance_name, token, row, row_json)

    def to_line(self) -> str:
        token = "batch" if self.token is None else str(self.token)
        return f"{self.stream_name} {self.instance_name} {token} {self.row_json}"

    def _key(self) -> tuple:
        return (self.stream_name, self.instance_name, self.token, encode_row(self.row))

    def __eq__(self, other: object) -> bool:
        if type(other) is not RdataCommand:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


_RDATA_FIELDS = attrs.fields(RdataCommand)


def _rdata(stream_name: str, instance_name: str, token_text: str, row_json: str) -> RdataCommand:
    """An RDATA command from the four fields of its line, checked as the
    validators would check them, without running them."""
    return _checked_rdata(*_rdata_fields(stream_name, instance_name, token_text, row_json), row_json)


def _rdata_fields(
    stream_name: str, instance_name: str, token_text: str, row_json: str
) -> tuple[str, str, int | None, Any]:
    """``(stream_name, instance_name, token or None, row)`` from the four
    fields of an RDATA line, or CommandParseError: the checks of ``_rdata``,
    without building a command. This is the worker's hot path (every check
    below is a C-level scan or a set lookup)."""
    if stream_name not in _known_words:
        _parse_word(stream_name, "stream_name")
    if instance_name not in _known_words:
        _parse_word(instance_name, "instance_name")
    if token_text == "batch":
        token = None
    elif token_text.isdigit() and token_text.isascii() and len(token_text) <= _MAX_TOKEN_DIGITS:
        token = int(token_text)
    else:
        token = _parse_token(token_text, "token")
    # A value from the first character to the last (what every encoder
    # writes), else decode_row for whitespace around it or the error.
    try:
        row, end = _scan_once(row_json, 0)
    except (StopIteration, ValueError, RecursionError):
        end = -1
    if end != len(row_json):
        row = decode_row(row_json)
    if not row_json.isascii():
        _check_writable(row_json, "row")
    return stream_name, instance_name, token, row


def parse_rdata_fields(line: str) -> tuple | None:
    """For an RDATA line that ``parse_command_from_line`` would parse into
    an RdataCommand: its ``(stream_name, instance_name, token or None, row)``
    (the row's top-level array a list), without building the command. None
    for any other line, including a bad RDATA line: parse it with
    ``parse_command_from_line`` for the command or the error. What a worker's
    protocol calls for every line before anything else."""
    if line.startswith("RDATA ") and "\n" not in line and "\r" not in line:
        parts = line.split(" ", 4)
        if len(parts) == 5:
            try:
                return _rdata_fields(parts[1], parts[2], parts[3], parts[4])
            except CommandParseError:
                return None
    return None


def _checked_rdata(stream_name: str, instance_name: str, token: int | None, row: Any, row_json: str) -> RdataCommand:
    """Build an RDATA command from fields the caller has checked, without
    the validators."""
    cmd = _new(RdataCommand)
    _set(cmd, "stream_name", stream_name)
    _set(cmd, "instance_name", instance_name)
    _set(cmd, "token", token)
    _set(cmd, "row", row)
    _set(cmd, "row_json", row_json)
    return cmd


@attrs.frozen
class UserSyncCommand(Command):
    """``USER_SYNC <instance_id> <user_id> <device_id> <state> <last_sync_ms>``.

    Sent by a client: a user (on one device) started (``state`` is ``start``)
    or stopped (``end``) syncing on that worker. As in Synapse, a missing
    device is written ``None``. The older form without the device
    (``USER_SYNC <instance_id> <user_id> <state> <last_sync_ms>``) is read as
    ``device_id=None``; ``stop`` is accepted as an alias of ``end`` on input;
    what we write is always the five-field form with ``start``/``end``.
    """

    NAME: ClassVar[str] = "USER_SYNC"
    instance_id: str = attrs.field(validator=_check_word)
    user_id: str = attrs.field(validator=_check_word)
    device_id: str | None = attrs.field()
    is_syncing: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    last_sync_ms: int = attrs.field(validator=_check_token)

    @device_id.validator
    def _check_device_id(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None:
            _check_word(self, attribute, value)

    @classmethod
    def from_line(cls, args: str) -> UserSyncCommand:
        words = args.split(" ")
        if len(words) == 5 and all(words):
            instance_id, user_id, device_id, state, last_sync_ms = words
            device: str | None = None if device_id == "None" else device_id
        elif len(words) == 4 and all(words):
            instance_id, user_id, state, last_sync_ms = words
            device = None
        else:
            raise CommandParseError(
                f"expected <instance_id> <user_id> [<device_id>] <start|end> <last_sync_ms>, got {describe(args)}"
            )
        if state == "start":
            is_syncing = True
        elif state in ("end", "stop"):
            is_syncing = False
        else:
            raise CommandParseError(f"USER_SYNC state must be start or end, got {describe(state)}")
        return _construct(cls, instance_id, user_id, device, is_syncing, _parse_token(last_sync_ms, "last_sync_ms"))

    def to_line(self) -> str:
        state = "start" if self.is_syncing else "end"
        return f"{self.instance_id} {self.user_id} {self.device_id} {state} {self.last_sync_ms}"


@attrs.frozen
class UserIpCommand(Command):
    """``USER_IP <user_id> <json>``, the JSON being
    ``[access_token, ip, user_agent, device_id, last_seen]``.

    Sent by a client when it saw a user's client make a request. The access
    token is left out of ``repr``.
    """

    NAME: ClassVar[str] = "USER_IP"
    user_id: str = attrs.field(validator=_check_word)
    access_token: str = attrs.field(repr=False, validator=_check_json_string)
    ip: str = attrs.field(validator=_check_json_string)
    user_agent: str = attrs.field(validator=_check_json_string)
    device_id: str | None = attrs.field(validator=_check_optional_text)
    last_seen: int = attrs.field(validator=_check_token)

    @classmethod
    def from_line(cls, args: str) -> UserIpCommand:
        user_id, _, rest = args.partition(" ")
        usage = "<user_id> [access_token, ip, user_agent, device_id, last_seen]"
        if not rest:
            raise CommandParseError(f"expected {usage}, got {describe(args)}")
        access_token, ip, user_agent, device_id, last_seen = _json_list(rest, 5, usage)
        return _construct(cls, user_id, access_token, ip, user_agent, device_id, last_seen)

    def to_line(self) -> str:
        fields = [self.access_token, self.ip, self.user_agent, self.device_id, self.last_seen]
        return f"{self.user_id} {encode_row(fields)}"


@attrs.frozen
class LockReleasedCommand(Command):
    """``LOCK_RELEASED ["<instance_name>", "<lock_name>", "<lock_key>"]``.

    Sent by either side: an instance released a named lock, so another
    waiting for it may try again.
    """

    NAME: ClassVar[str] = "LOCK_RELEASED"
    instance_name: str = attrs.field(validator=_check_json_string)
    lock_name: str = attrs.field(validator=_check_json_string)
    lock_key: str = attrs.field(validator=_check_json_string)

    @classmethod
    def from_line(cls, args: str) -> LockReleasedCommand:
        fields = _json_list(args, 3, '["<instance_name>", "<lock_name>", "<lock_key>"]')
        return _construct(cls, *fields)

    def to_line(self) -> str:
        return encode_row([self.instance_name, self.lock_name, self.lock_key])


class _OneWordCommand(Command):
    """Base for commands whose only argument is a single word."""

    @classmethod
    def from_line(cls, args: str):
        (word,) = _split_words(args, 1, "<argument>")
        return _construct(cls, word)

    def to_line(self) -> str:
        return getattr(self, attrs.fields(type(self))[0].name)


@attrs.frozen
class ClearUserSyncCommand(_OneWordCommand):
    """``CLEAR_USER_SYNC <instance_id>``: sent by a client (usually when shutting
    down): forget every user sync it reported."""

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    instance_id: str = attrs.field(validator=_check_word)


@attrs.frozen
class RemoteServerUpCommand(_OneWordCommand):
    """``REMOTE_SERVER_UP <server>``: sent by either side: a remote homeserver
    may be reachable again."""

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    server: str = attrs.field(validator=_check_word)


@attrs.frozen
class FederationAckCommand(Command):
    """``FEDERATION_ACK <instance_name> <token>``: sent by the federation sender
    worker once it has processed the federation stream up to ``token``."""

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance_name: str = attrs.field(validator=_check_word)
    token: int = attrs.field(validator=_check_token)

    @classmethod
    def from_line(cls, args: str) -> FederationAckCommand:
        instance_name, token = _split_words(args, 2, "<instance_name> <token>")
        return _construct(cls, instance_name, _parse_token(token, "token"))

    def to_line(self) -> str:
        return f"{self.instance_name} {self.token}"


#: Every command type by its wire name. Read-only.
COMMAND_TYPES: Mapping[str, type[Command]] = MappingProxyType(
    {
        cmd.NAME: cmd
        for cmd in (
            ServerCommand,
            NameCommand,
            PingCommand,
            ErrorCommand,
            ReplicateCommand,
            PositionCommand,
            RdataCommand,
            UserSyncCommand,
            ClearUserSyncCommand,
            FederationAckCommand,
            RemoteServerUpCommand,
            AuthCommand,
            UserIpCommand,
            LockReleasedCommand,
            NewActiveTaskCommand,
            CancelTaskCommand,
        )
    }
)

#: Names of the commands a server may send (so a client may receive).
SERVER_SENT_COMMANDS = frozenset({"SERVER", "RDATA", "POSITION", "ERROR", "PING", "REMOTE_SERVER_UP", "LOCK_RELEASED"})

#: Names of the commands a client may send (so a server may receive).
CLIENT_SENT_COMMANDS = frozenset(
    {
        "AUTH",
        "NAME",
        "REPLICATE",
        "ERROR",
        "PING",
        "USER_SYNC",
        "CLEAR_USER_SYNC",
        "FEDERATION_ACK",
        "REMOTE_SERVER_UP",
        "USER_IP",
        "LOCK_RELEASED",
        "NEW_ACTIVE_TASK",
        "CANCEL_TASK",
    }
)

#: The client-sent commands a server hands to the session behind the
#: connection, unchanged: all but the connection's own (AUTH, NAME,
#: REPLICATE, PING, ERROR).
CLIENT_NOTIFICATIONS = CLIENT_SENT_COMMANDS - {"AUTH", "NAME", "REPLICATE", "PING", "ERROR"}


def parse_command_from_line(line: str) -> Command:
    """Parse one line (delimiter already stripped) into a command.

    Raises :class:`UnknownCommandError` if the first word is not a known
    command name, and :class:`CommandParseError` for anything else that is
    wrong (including an empty line or an embedded line break). Raises nothing
    else, whatever the input.
    """
    if "\n" in line or "\r" in line:
        name = line.partition(" ")[0]
        if name in COMMAND_TYPES:
            raise CommandParseError("line contains a line break")
        raise UnknownCommandError(name)
    if line.startswith("RDATA "):
        # Most lines a worker reads: split once, not name then arguments.
        parts = line.split(" ", 4)
        if len(parts) == 5:
            # _rdata's two steps called here, one call fewer a line.
            row_json = parts[4]
            return _checked_rdata(*_rdata_fields(parts[1], parts[2], parts[3], row_json), row_json)
    name, _, args = line.partition(" ")
    cmd_type = _COMMAND_TYPES_GET(name)
    if cmd_type is None:
        if not line:
            raise CommandParseError("empty line")
        raise UnknownCommandError(name)
    return cmd_type.from_line(args)


_COMMAND_TYPES_GET = dict(COMMAND_TYPES).get


def serialize_command(cmd: Command) -> str:
    """Return the full line for ``cmd``, without the trailing delimiter."""
    args = cmd.to_line()
    return f"{cmd.NAME} {args}" if args else cmd.NAME
