"""The field grammar of replication command lines, shared by every command.

Words (stream, instance and user names), tokens, free text and JSON
arguments: the attrs validators that check them when a command is built,
the parsers that check the same things on the worker's hot path without
the validators, and the one compact deterministic JSON encoding of rows
(:func:`encode_row` / :func:`decode_row`). :mod:`.commands` re-exports the
public names; nothing here does I/O or logging.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

__all__ = [
    "MAX_LINE_LENGTH",
    "CommandParseError",
    "UnknownCommandError",
    "decode_row",
    "describe",
    "encode_row",
]

#: Default maximum length of one line in bytes, delimiter excluded: Synapse's
#: (Twisted's ``LineOnlyReceiver.MAX_LENGTH``), which closes the connection on
#: a longer line. ``ReplicationConfig.max_line_length`` overrides it.
MAX_LINE_LENGTH = 16 * 1024

# Tokens are bigints in the database: at most 20 ASCII digits. A bound also
# keeps int() away from Python's quadratic huge-number parsing.
_MAX_TOKEN_DIGITS = 20


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


#: Longest NAME or SERVER a peer may send, in UTF-8 bytes (a server name's
#: limit in the spec; instance names are short words).
MAX_PEER_NAME_BYTES = 255
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def _check_peer_name(_inst: object, attribute: attrs.Attribute, value: str) -> None:
    """A name a person reads in logs: no control characters (NUL included), not too long."""
    if _CONTROL_CHARACTER.search(value):
        raise ValueError(f"{attribute.name} must not contain control characters")
    if len(value.encode("utf-8")) > MAX_PEER_NAME_BYTES:
        raise ValueError(f"{attribute.name} is longer than {MAX_PEER_NAME_BYTES} bytes")


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


# CPython's C encoder and scanner are private to the json package: typeshed does not declare them.
if json.encoder.c_make_encoder is not None:  # type: ignore[attr-defined]
    _c_encoder = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None, _not_serialisable, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, False
    )

    def _encode(value: Any) -> str:
        return "".join(_c_encoder(value, 0))

else:  # pragma: no cover - CPython always has the C encoder
    _encoder = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True, allow_nan=False)

    def _encode(value: Any) -> str:
        return _encoder.encode(value)


#: ``encode_row`` without turning errors into ValueError (TypeError,
#: ValueError or RecursionError): for loops that fall back to a slower path
#: which reports them.
encode_fast = _encode


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
_scan_once = _decoder.scan_once  # type: ignore[attr-defined]  # set by JSONDecoder.__init__, not declared


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


def parse_rdata_lines(lines: list[str]) -> tuple[tuple, tuple, list, list] | None:
    """For lines that are all RDATA lines in their plain form, their fields
    as four sequences: stream names, instance names, tokens (None for
    ``batch``) and rows (a top-level array a list); None if any line is not,
    for the caller to take them one by one (``parse_rdata_fields``, which
    gives each line's answer). The plain form: what ``parse_rdata_fields``
    accepts, with the row's JSON from the first character to the last and
    ASCII (what every encoder writes, and Synapse writes for the rows of
    the store's streams). Each check is made on all the lines at once, with
    no step per line in Python beyond list comprehensions: a worker's chunk
    of lines is parsed at about the JSON decoder's pace."""
    fields = [line.split(" ", 4) for line in lines]
    if not fields or min(map(len, fields)) != 5:
        return None
    names, streams, instances, token_texts, rows_json = zip(*fields, strict=True)
    if set(names) != {"RDATA"} or "\r" in "".join(lines):
        return None
    words = set(streams)
    words.update(instances)
    if not words <= _known_words:
        for word in words - _known_words:
            if not _is_word(word):
                return None
        if len(_known_words) + len(words) <= _MAX_KNOWN_WORDS:
            _known_words.update(words)
    numbers = set(token_texts)
    numbers.discard("batch")
    digits = "".join(numbers)
    if numbers and (
        not digits.isdigit() or not digits.isascii() or "" in numbers or max(map(len, numbers)) > _MAX_TOKEN_DIGITS
    ):
        return None
    token_of: dict[str, int | None] = {text: int(text) for text in numbers}
    token_of["batch"] = None
    tokens = list(map(token_of.__getitem__, token_texts))
    if not "".join(rows_json).isascii():
        return None
    scan = _scan_once
    try:
        scanned = [scan(row_json, 0) for row_json in rows_json]
    except (StopIteration, ValueError, RecursionError):
        return None
    if [end for _, end in scanned] != list(map(len, rows_json)):
        return None
    return streams, instances, tokens, [row for row, _ in scanned]


def parse_rdata_run(text: str, count: int) -> tuple[str, str, list, tuple] | None:
    """``parse_rdata_lines`` for ``count`` RDATA lines of one stream and
    writer given as one text (joined by newlines): ``(stream_name,
    instance_name, tokens, rows)``, tokens None for ``batch``; None for any
    other text (lines of several streams or writers, or any line not in the
    plain form), for the caller to parse line by line. A line's prefix
    (``RDATA <stream> <writer> ``) is checked and cut off for all of them
    at once: what a worker catching up reads, parsed with one step per line
    in Python beside the JSON decoder's."""
    head_end = text.find(" ", text.find(" ", 6) + 1) + 1
    head = text[:head_end]
    separator = "\n" + head
    if (
        head_end <= 6
        or not text.startswith("RDATA ")
        or text.count(separator) != count - 1
        or not text.isascii()
        or "\r" in text
    ):
        return None
    stream_name, _, instance_name = head[6:-1].partition(" ")
    if not (stream_name in _known_words and instance_name in _known_words):
        if not (_is_word(stream_name) and _is_word(instance_name)):
            return None
        if len(_known_words) + 2 <= _MAX_KNOWN_WORDS:
            _known_words.update((stream_name, instance_name))
    pairs = [line.split(" ", 1) for line in text[head_end:].replace(separator, "\n").split("\n")]
    if min(map(len, pairs)) != 2:
        return None
    token_texts, rows_json = zip(*pairs, strict=True)
    numbers = set(token_texts)
    numbers.discard("batch")
    if numbers and ("" in numbers or not "".join(numbers).isdigit() or max(map(len, numbers)) > _MAX_TOKEN_DIGITS):
        return None
    token_of: dict[str, int | None] = dict(zip(numbers, map(int, numbers), strict=True))
    token_of["batch"] = None
    scan = _scan_once
    try:
        rows, ends = zip(*[scan(row_json, 0) for row_json in rows_json], strict=True)
    except (StopIteration, ValueError, RecursionError):
        return None
    if ends != tuple(map(len, rows_json)):
        return None
    return stream_name, instance_name, list(map(token_of.__getitem__, token_texts)), rows
