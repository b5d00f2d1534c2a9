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
import json
import math
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, TypeVar

import attrs

__all__ = [
    "AuthCommand",
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
    "serialize_command",
]

#: Default maximum length of one line in bytes, delimiter excluded: Synapse's
#: (Twisted's ``LineOnlyReceiver.MAX_LENGTH``), which closes the connection on
#: a longer line. ``ReplicationConfig.max_line_length`` overrides it.
MAX_LINE_LENGTH = 16 * 1024

# Tokens are bigints in the database: at most 20 ASCII digits. A bound also
# keeps int() away from Python's quadratic huge-number parsing.
_MAX_TOKEN_DIGITS = 20

_C = TypeVar("_C", bound="Command")


class CommandParseError(ValueError):
    """A line, or the arguments of a command, could not be parsed.

    ``reason`` is a short human-readable explanation that is safe to send back
    to the peer in an ``ERROR`` line: any peer-supplied text in it has been
    passed through :func:`describe`, so it holds no line breaks.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownCommandError(CommandParseError):
    """The first word of a line is not a command name in :data:`COMMAND_TYPES`.

    A subclass of :class:`CommandParseError` so a caller may handle both
    alike, but its own type so a caller can tell them apart.
    """

    def __init__(self, command_name: str) -> None:
        super().__init__(f"unknown command {describe(command_name)}")
        self.command_name = command_name


def describe(value: str, limit: int = 64) -> str:
    """Return ``repr(value)`` cut to about ``limit`` characters.

    Used to quote peer input inside log lines and ERROR messages: ``repr``
    escapes line breaks and unprintable characters, so the result is always
    safe to put on one line.
    """
    if len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)


# ---------------------------------------------------------------------------
# Field validators and parsers. Validators raise ValueError/TypeError at
# construction; the from_line methods turn those into CommandParseError.


def _check_word(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")
    if not _is_word(value):
        raise ValueError(f"{attribute.name} must not contain whitespace or control characters: {describe(value)}")


def _is_word(value: str) -> bool:
    """A non-empty name with no whitespace, control character or lone
    surrogate: ``isprintable`` is false for every whitespace character but
    the space (and for the rest), so two C-level scans decide it."""
    return value.isprintable() and " " not in value and value != ""


def _check_text(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, not {type(value).__name__}")
    if "\n" in value or "\r" in value:
        raise ValueError(f"{attribute.name} must not contain a line break")
    _check_encodable(attribute, value)


def _check_encodable(attribute: attrs.Attribute, value: str) -> None:
    # Lone surrogates survive str operations but cannot be written as UTF-8.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{attribute.name} is not encodable as UTF-8") from None


def _check_nonempty(_inst: object, attribute: attrs.Attribute, value: str) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


def _check_token(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    # bool is an int subclass; True as a token is always a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative")


def _check_optional_token(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _check_token(inst, attribute, value)


def _parse_token(text: str, what: str) -> int:
    # isdigit alone accepts other scripts' digits; isascii is O(1).
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_TOKEN_DIGITS):
        raise CommandParseError(f"{what} must be a non-negative integer, got {describe(text)}")
    return int(text)


#: Names seen in valid lines (stream and instance names repeat on every
#: RDATA line): a set lookup instead of a scan. Bounded so that a peer
#: sending ever-new names cannot grow it.
_known_words: set[str] = set()
_MAX_KNOWN_WORDS = 1024


def _parse_word(text: str, what: str) -> str:
    if text in _known_words:
        return text
    if not _is_word(text):
        raise CommandParseError(
            f"{what} must be a non-empty word with no whitespace or control characters, got {describe(text)}"
        )
    if len(_known_words) < _MAX_KNOWN_WORDS:
        _known_words.add(text)
    return text


def _split_words(args: str, count: int, usage: str) -> list[str]:
    """Split ``args`` into exactly ``count`` non-empty space-separated words."""
    words = args.split(" ")
    if len(words) != count or not all(words):
        raise CommandParseError(f"expected {usage}, got {describe(args)}")
    return words


# Built once: json.dumps/json.loads with any non-default argument build a
# new encoder/decoder on every call, and JSONEncoder.encode builds a new C
# encoder on every call too. The C encoder is called directly (no circular
# check: a row is data read from the database or off the wire; a cycle
# ends in RecursionError, which encode_row turns into ValueError).
def _not_serialisable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


if json.encoder.c_make_encoder is not None:
    _c_encoder = json.encoder.c_make_encoder(
        None, _not_serialisable, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, False
    )

    def _encode(value: Any) -> str:
        return "".join(_c_encoder(value, 0))

else:  # pragma: no cover - CPython always has the C encoder
    _encode = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True, allow_nan=False).encode


def encode_row(row: Any) -> str:
    """Encode a stream row (or any JSON value) as compact, deterministic JSON.

    Raises ``ValueError`` if ``row`` cannot be encoded (unsupported types,
    NaN/infinity, or nesting too deep).
    """
    try:
        return _encode(row)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"row is not JSON-serialisable: {e}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # Only called for numbers with a fraction or exponent; 1e999 would
    # decode to infinity, which no encoder can write back.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{describe(text)} is not JSON-serialisable (out of range)")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_scan_once = _decoder.scan_once


def decode_row(row_json: str) -> Any:
    """Decode the ``<row_json>`` of an RDATA line (or any JSON argument), or
    raise CommandParseError."""
    # Fast path: a value starting at the first character and ending at the
    # last (what every encoder writes). The scanner is the C one json.loads
    # uses, without loads' whitespace handling around it.
    try:
        value, end = _scan_once(row_json, 0)
        if end == len(row_json):
            return value
    except (StopIteration, ValueError, RecursionError):
        pass
    # Whitespace around the value, or an error: the full decoder, for the
    # exact answer and its message.
    try:
        return _decoder.decode(row_json)
    except (ValueError, RecursionError) as e:
        reason = str(e)
        if "JSON-serialisable" in reason:
            raise CommandParseError(f"row is {reason.partition(' is ')[2]}") from None
        raise CommandParseError(f"row is not valid JSON: {describe(reason)}") from None


def _check_writable(text: str, what: str) -> str:
    """Text taken from a line verbatim (a row's JSON) must encode as UTF-8
    again: only a lone surrogate can stop it, and an ASCII string (O(1) to
    tell) has none."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise CommandParseError(f"{what} is not encodable as UTF-8") from None
    return text


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
    def from_line(cls, args: str):  # type: ignore[override]
        return _construct(cls, args)

    def to_line(self) -> str:
        return self.text  # type: ignore[attr-defined]


@attrs.frozen
class ServerCommand(_TextCommand):
    """``SERVER <server_name>``: sent by the server on connect, naming itself."""

    NAME: ClassVar[str] = "SERVER"
    text: str = attrs.field(validator=[_check_text, _check_nonempty])

    @property
    def server_name(self) -> str:
        return self.text


@attrs.frozen
class NameCommand(_TextCommand):
    """``NAME <client_name>``: sent by the client on connect, naming itself."""

    NAME: ClassVar[str] = "NAME"
    text: str = attrs.field(validator=[_check_text, _check_nonempty])

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
    def from_line(cls, args: str) -> "ReplicateCommand":
        if args == "":
            return cls()
        stream_name, token_text = _split_words(
            args, 2, "nothing or <stream_name> <token>"
        )
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
    def from_line(cls, args: str) -> "PositionCommand":
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
    def from_line(cls, args: str) -> "RdataCommand":
        parts = args.split(" ", 3)
        if len(parts) != 4:
            raise CommandParseError(
                "expected <stream_name> <instance_name> <token> <row_json>, "
                f"got {describe(args)}"
            )
        return _rdata(*parts)

    @classmethod
    def from_encoded(
        cls, stream_name: str, instance_name: str, token: int | None, row: Any, row_json: str
    ) -> "RdataCommand":
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
    validators would check them, without running them: this is the worker's
    hot path (every check below is a C-level scan or a set lookup)."""
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
    return _checked_rdata(stream_name, instance_name, token, row, row_json)


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
    def from_line(cls, args: str) -> "UserSyncCommand":
        words = args.split(" ")
        if len(words) == 5 and all(words):
            instance_id, user_id, device_id, state, last_sync_ms = words
            device: str | None = None if device_id == "None" else device_id
        elif len(words) == 4 and all(words):
            instance_id, user_id, state, last_sync_ms = words
            device = None
        else:
            raise CommandParseError(
                "expected <instance_id> <user_id> [<device_id>] <start|end> <last_sync_ms>, "
                f"got {describe(args)}"
            )
        if state == "start":
            is_syncing = True
        elif state in ("end", "stop"):
            is_syncing = False
        else:
            raise CommandParseError(f"USER_SYNC state must be start or end, got {describe(state)}")
        return _construct(
            cls, instance_id, user_id, device, is_syncing, _parse_token(last_sync_ms, "last_sync_ms")
        )

    def to_line(self) -> str:
        state = "start" if self.is_syncing else "end"
        return f"{self.instance_id} {self.user_id} {self.device_id} {state} {self.last_sync_ms}"


def _check_optional_text(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _check_json_string(inst, attribute, value)


def _check_json_string(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    # Carried inside a JSON array: any string JSON can hold (escaped on the
    # wire), except a lone surrogate, which UTF-8 cannot.
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, not {type(value).__name__}")
    _check_encodable(attribute, value)


def _json_list(args: str, count: int, usage: str) -> list:
    value = decode_row(_check_writable(args, "argument"))
    if type(value) is not list or len(value) != count:
        raise CommandParseError(f"expected {usage}, got {describe(args)}")
    return value


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
    def from_line(cls, args: str) -> "UserIpCommand":
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
    def from_line(cls, args: str) -> "LockReleasedCommand":
        fields = _json_list(args, 3, '["<instance_name>", "<lock_name>", "<lock_key>"]')
        return _construct(cls, *fields)

    def to_line(self) -> str:
        return encode_row([self.instance_name, self.lock_name, self.lock_key])


class _OneWordCommand(Command):
    """Base for commands whose only argument is a single word."""

    @classmethod
    def from_line(cls, args: str):  # type: ignore[override]
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
    def from_line(cls, args: str) -> "FederationAckCommand":
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
SERVER_SENT_COMMANDS = frozenset(
    {"SERVER", "RDATA", "POSITION", "ERROR", "PING", "REMOTE_SERVER_UP", "LOCK_RELEASED"}
)

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
            return _rdata(parts[1], parts[2], parts[3], parts[4])
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
