"""Decoding a PDU's bytes into its JSON object, every value checked, and
the error every check of a PDU raises.

``decoded_event`` is the first step of ``roomstore.pdu.parsing.parse_pdu``
(whose docstring gives the rules and why): size, UTF-8, JSON without
duplicate keys or non-finite numbers, strings that are valid Unicode, the
integer and float rules of strict canonical JSON, and a bound on nesting.
The decoders' hooks note what needs a closer look, so nearly every event is
decoded once and never walked.
"""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

import orjson
from canonicaljson import encode_canonical_json

from roomstore.pdu.room_versions import RoomVersion

__all__ = [
    "CANONICALJSON_MAX_INT",
    "CANONICALJSON_MIN_INT",
    "InvalidEventError",
    "MAX_JSON_NESTING",
    "MAX_PDU_SIZE",
    "decoded_event",
    "quick_json",
    "json_type_name",
    "nesting_depth",
]

#: Maximum size of a PDU in bytes (spec "Size limits").
MAX_PDU_SIZE = 65536
#: Integer range allowed by strict canonical JSON (room versions 6+).
CANONICALJSON_MAX_INT = 2**53 - 1
CANONICALJSON_MIN_INT = -CANONICALJSON_MAX_INT
#: Deepest nesting of JSON objects and arrays in a PDU, the event itself
#: counting as one (``parse_pdu``'s docstring says why 128).
MAX_JSON_NESTING = 128


class InvalidEventError(ValueError):
    """A PDU failed validation.

    ``str(error)`` names the problem; ``field`` is the dotted path of the
    offending key when the problem is tied to one (e.g. ``"depth"`` or
    ``"content.membership"``), else None.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def decoded_event(raw: bytes, room_version: RoomVersion) -> tuple[dict[str, Any], bool]:
    """(``raw`` decoded as the JSON object of a PDU: its type, size, UTF-8,
    JSON values and canonical size checked; whether the parser saw a float)."""
    if not isinstance(raw, bytes):
        raise TypeError(f"raw must be bytes, not {type(raw).__name__}")
    if len(raw) > MAX_PDU_SIZE:
        raise InvalidEventError(f"PDU is {len(raw)} bytes; the limit is {MAX_PDU_SIZE} bytes")
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise InvalidEventError(f"PDU is not valid UTF-8: invalid byte(s) at offset {e.start}") from None

    event, suspects = _load_json(text, room_version.strict_canonicaljson)
    # Each opening bracket is at most one level: only a text with more than
    # the bound can be too deep (a count in C, no walk for nearly every event).
    if text.count("{") + text.count("[") > MAX_JSON_NESTING:
        depth = nesting_depth(event)
        if depth > MAX_JSON_NESTING:
            raise InvalidEventError(f"PDU JSON is nested {depth} levels deep; the limit is {MAX_JSON_NESTING}")
    if suspects or ("\\u" in text and _SURROGATE_ESCAPE.search(text)):
        # Something the parser saw may be invalid: walk every value for the
        # exact error. Otherwise no value can be (see _load_json).
        _check_json_values(event, room_version)

    if suspects & _FLOAT_SEEN:
        # Only a float can make the canonical form longer than the bytes
        # received (1e300 has 300 digits); without one it is never longer.
        try:
            canonical_size = len(encode_canonical_json(event))
        except RecursionError:
            raise InvalidEventError("PDU JSON is nested too deeply") from None
        if canonical_size > MAX_PDU_SIZE:
            raise InvalidEventError(
                f"PDU is {canonical_size} bytes as canonical JSON; the limit is {MAX_PDU_SIZE} bytes"
            )
    return event, bool(suspects & _FLOAT_SEEN)


def quick_json(raw: bytes) -> Any:
    """``raw`` decoded by orjson, several times faster than ``json.loads``
    (for the looks taken on the reactor thread before validation), or None
    where orjson refuses it or it might nest past orjson's depth: there the
    caller asks ``json.loads``, which decides and words the error as always.
    orjson accepts no JSON that ``json.loads`` refuses, and reads the same
    values (the last of repeated keys, as ``json.loads``)."""
    if raw.count(b"{") + raw.count(b"[") > _QUICK_MAX_BRACKETS:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


#: Fewer opening brackets than this cannot nest past orjson's limit (1024)
#: nor Python's recursion limit in ``json.loads``.
_QUICK_MAX_BRACKETS = 500


def nesting_depth(value: Any) -> int:
    """How deeply ``value`` nests objects and arrays (a scalar: 0, ``{}``: 1).
    Iterative: any depth the JSON parser produced is measured."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidEventError(f"PDU JSON has a duplicate object key {key!r}")
            seen.add(key)
    return result


def _reject_constant(name: str) -> Any:
    raise InvalidEventError(f"PDU JSON contains {name}, which is not valid JSON")


#: A JSON escape of a UTF-16 surrogate: the only way a string can hold one,
#: since strict UTF-8 decoding refuses encoded surrogates.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_FLOAT_SEEN = 1
_INT_OUT_OF_RANGE = 2


class _ParseState(threading.local):
    """Per thread: the decoders (their hooks are reused, not made per call)
    and what the hooks saw during the current parse."""

    def __init__(self) -> None:
        self.suspects = 0
        self.plain = json.JSONDecoder(
            object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant, parse_float=_on_float
        )
        # Strict room versions: each integer's range looked at.
        self.checking_ints = json.JSONDecoder(
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
            parse_float=_on_float,
            parse_int=_on_int,
        )


def _on_float(literal: str) -> float:
    _state.suspects |= _FLOAT_SEEN
    return float(literal)


def _on_int(literal: str) -> int:
    value = int(literal)
    if not CANONICALJSON_MIN_INT <= value <= CANONICALJSON_MAX_INT:
        _state.suspects |= _INT_OUT_OF_RANGE
    return value


_state = _ParseState()


def _load_json(text: str, strict_ints: bool) -> tuple[dict[str, Any], int]:
    """Parse a PDU; returns ``(object, suspects)``.

    ``suspects`` flags what the parser met that ``_check_json_values`` must
    look at: a float (never allowed in strict room versions, and possibly
    infinite), an integer outside canonical JSON's range when ``strict_ints``.
    Noting these while parsing spares walking every value of every event.
    """
    state = _state
    state.suspects = 0
    decoder = state.checking_ints if strict_ints else state.plain
    if text.startswith("\ufeff"):  # json.loads says so; JSONDecoder.decode would only say "Expecting value"
        raise InvalidEventError(
            "PDU is not valid JSON: it begins with a byte order mark (U+FEFF); send the JSON without it"
        )
    try:
        value = decoder.decode(text)
    except InvalidEventError:
        raise
    except json.JSONDecodeError as e:
        raise InvalidEventError(f"PDU is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidEventError(f"PDU JSON is nested too deeply; the limit is {MAX_JSON_NESTING} levels") from None
    except ValueError as e:  # e.g. integers longer than int_max_str_digits
        raise InvalidEventError(f"PDU is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidEventError(f"PDU must be a JSON object, got {json_type_name(value)}")
    return value, state.suspects


def _check_json_values(event: dict[str, Any], room_version: RoomVersion) -> None:
    """Check every value: encodable strings, finite numbers, strict ranges.

    Iterative, so deep nesting that the JSON parser accepted cannot overflow
    the Python stack here.
    """
    strict = room_version.strict_canonicaljson
    stack: list[tuple[Any, str]] = [(event, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                child_path = f"{path}.{key}" if path else key
                _check_string(key, child_path)
                stack.append((child, child_path))
        elif isinstance(value, list):
            for index, child in enumerate(value):
                stack.append((child, f"{path}[{index}]"))
        elif isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if strict and not CANONICALJSON_MIN_INT <= value <= CANONICALJSON_MAX_INT:
                raise InvalidEventError(
                    f"integer at {path!r} is outside the range allowed by canonical "
                    f"JSON in room version {room_version.identifier}",
                    path,
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidEventError(
                    f"number at {path!r} overflows to {value!r}, which JSON cannot represent",
                    path,
                )
            if strict:
                raise InvalidEventError(
                    f"floats are not allowed in room version {room_version.identifier} (found {value!r} at {path!r})",
                    path,
                )


def _check_string(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEventError(f"string at {path!r} contains an unpaired UTF-16 surrogate escape", path) from None


def json_type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
