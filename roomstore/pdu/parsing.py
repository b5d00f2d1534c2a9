"""Parse and validate a PDU received as raw bytes.

:func:`parse_pdu` is the gate every event passes before it is stored.  It
never re-serialises: :attr:`ParsedPdu.raw` is the input bytes unchanged, so
what we store and later serve is exactly what we received (and, e.g., a
``\\u0000`` escape in ``content`` is kept as the six bytes ``\\u0000``).

Decisions not fixed by the spec, and why:

* **Duplicate object keys are rejected** (anywhere in the document).  JSON
  leaves their meaning open; parsers disagree on first-vs-last wins, so a
  duplicated key lets two servers hash, sign or authorise different events
  from the same bytes.  Canonical JSON cannot contain them, so no honest
  sender produces them.
* **NaN, Infinity, -Infinity and overflowing floats** (``1e400``) are
  rejected in every room version: they are not JSON and canonical JSON
  cannot encode them.  From v6 ("strict canonical JSON") any float, and any
  integer outside [-(2**53)+1, 2**53-1], is rejected too.
* **Strings that are not valid Unicode** (a lone-surrogate escape such as
  ``"\\ud800"``) are rejected: they cannot be encoded as UTF-8, so the event
  could not be canonicalised, hashed or checked.
* **Size**: the raw bytes must not exceed 65,536 bytes (checked before
  parsing, so oversized input costs nothing), and neither may the canonical
  encoding of the parsed event, which is how the spec measures it ("when
  formatted with the federation event format, including any signatures, and
  encoded as Canonical JSON").
* **Identifier lengths**: ``sender``, ``room_id``, ``state_key``, ``type``
  and ``event_id`` must be at most 255 bytes of UTF-8 (spec "Size limits").
* **v3+ PDUs must not carry ``event_id``**.  The spec says event IDs "should
  not be sent over federation" in these versions; the ID is computed.  An
  ``event_id`` key would be covered by the reference hash (the redaction
  algorithm keeps it), so tolerating it would make the computed ID depend on
  a key the sender did not hash; rejecting is the unambiguous choice.
* ``depth`` must be in [0, 2**63-1] (the spec's maximum; Synapse also rejects
  negative depths).  ``origin_server_ts`` must be an integer that fits the
  databases' 64-bit columns, [-(2**63), 2**63-1], in every room version (v6+
  narrow it further to canonical JSON's range); booleans are never accepted
  where an integer is required.
* **Nesting**: at most :data:`MAX_JSON_NESTING` (128) levels of objects and
  arrays, the event object itself counting as one.  The spec sets no bound;
  serde_json, which ruma-based servers parse with, stops at 128, and a bound
  far below Python's recursion limit keeps every reader of stored JSON
  (``json.loads`` on a read, canonical JSON, the redaction algorithm) safe
  at any call depth: nothing the writer accepts may fail to read back.
* **An event may not cite itself** in ``prev_events`` or ``auth_events``
  (possible only where the PDU names its own ID, v1/v2); cycles across
  events are refused when a batch is ordered (``events.write.batch.order_batch``).
* **Room version 12 room IDs** (MSC4291).  The create event
  (``m.room.create`` with state key ``""``) must not carry ``room_id``: its
  room ID is ``!`` + its reference hash, which :attr:`ParsedPdu.room_id`
  holds.  One that carries a ``room_id`` is refused, whatever the value (the
  spec's auth rule 1.2 rejects it, and Synapse will not even parse it; the ID
  derived from its hash cannot be it either, as the hash covers
  ``room_id``).  Every other event's ``room_id`` must be a v12 room ID: ``!``
  + 43 URL-safe base64 characters, no server part.  ``auth_events`` must not
  list the room's create event (``$`` + the room ID's hash, as Synapse
  refuses it on receipt): it is implied, see
  :attr:`ParsedPdu.auth_chain_event_ids`.
* ``m.room.member`` events need a ``state_key`` and a string
  ``content.membership``; ``redacts`` (top level before v11, in ``content``
  from v11) must be a string when present on an ``m.room.redaction``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from roomstore.pdu.hashing import compute_event_id
from roomstore.pdu.json_decoding import (
    CANONICALJSON_MAX_INT,
    CANONICALJSON_MIN_INT,
    MAX_JSON_NESTING,
    MAX_PDU_SIZE,
    InvalidEventError,
    decoded_event,
    json_type_name,
    nesting_depth,
)
from roomstore.pdu.redaction_algorithm import redacts_of
from roomstore.pdu.room_versions import EventIdFormat, RoomVersion, get_room_version

__all__ = [
    "CANONICALJSON_MAX_INT",
    "CANONICALJSON_MIN_INT",
    "InvalidEventError",
    "MAX_DEPTH",
    "MAX_IDENTIFIER_BYTES",
    "MAX_JSON_NESTING",
    "MAX_PDU_SIZE",
    "ParsedPdu",
    "create_event_id_of",
    "is_valid_event_id",
    "nesting_depth",
    "parse_pdu",
    "room_id_of_create",
    "stored_pdu",
]

#: Maximum UTF-8 length of sender, room_id, state_key, type and event_id.
MAX_IDENTIFIER_BYTES = 255
#: Largest allowed ``depth`` ("less than the maximum value for an integer (2^63 - 1)").
MAX_DEPTH = 2**63 - 1
#: The range of the databases' 64-bit integer columns (``origin_server_ts``).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Keys every PDU must have, checked in this order so the error is stable.
_REQUIRED_KEYS = (
    "room_id",
    "sender",
    "type",
    "content",
    "origin_server_ts",
    "depth",
    "prev_events",
    "auth_events",
    "hashes",
    "signatures",
)

_EVENT_ID_PATTERNS = {
    # "$" opaque ":" server_name; the opaque part cannot contain ":".
    EventIdFormat.V1_V2: re.compile(r"\$[^:]+:.+", re.DOTALL),
    # sha256 is 32 bytes -> 43 unpadded base64 characters.
    EventIdFormat.V3: re.compile(r"\$[A-Za-z0-9+/]{43}", re.ASCII),
    EventIdFormat.V4_PLUS: re.compile(r"\$[A-Za-z0-9_-]{43}", re.ASCII),
}
# Without a dict lookup by enum (an Enum's hash is Python code).
_V3_EVENT_ID = _EVENT_ID_PATTERNS[EventIdFormat.V3]
_V4_EVENT_ID = _EVENT_ID_PATTERNS[EventIdFormat.V4_PLUS]
#: A room version 12 room ID: "!" + the create event's reference hash.
_HASH_ROOM_ID = re.compile(r"![A-Za-z0-9_-]{43}", re.ASCII)


@attrs.frozen(order=True)  # as attr.s: ordered by its compared fields
class ParsedPdu:
    """A validated PDU.

    Equality and hashing use the raw bytes and the derived scalar fields;
    ``content`` and ``event_dict`` are excluded because dicts are not
    hashable (they are derived from ``raw`` anyway).  Treat both dicts as
    read-only: they are shared, not copies.
    """

    event_id: str
    room_id: str
    sender: str
    type: str
    #: None for non-state events.
    state_key: str | None
    depth: int
    origin_server_ts: int
    prev_event_ids: tuple[str, ...]
    auth_event_ids: tuple[str, ...]
    #: For ``m.room.redaction``: the redacted event's ID, read from the
    #: version's location (top level before v11, ``content`` from v11).
    redacts: str | None
    #: ``content.membership`` for ``m.room.member`` events, else None.
    membership: str | None
    room_version: RoomVersion = attrs.field(repr=lambda v: f"<room version {v.identifier}>")
    #: The bytes exactly as received (left out of repr: up to 64 KiB).
    raw: bytes = attrs.field(repr=False)
    #: ``content`` and ``event_dict`` (the properties): given, or, for a PDU
    #: that crossed a process boundary (``__reduce__``), None until first
    #: asked for, then decoded from ``raw``.
    _content: Mapping[str, Any] | None = attrs.field(alias="content", eq=False, repr=False)
    _event_dict: Mapping[str, Any] | None = attrs.field(alias="event_dict", eq=False, repr=False)
    #: Whether the JSON may hold a float (the parser saw one): canonical JSON
    #: of it then takes canonicaljson's path (``roomstore.pdu.canonical``).
    has_floats: bool = attrs.field(default=True, eq=False, repr=False)

    @property
    def event_dict(self) -> Mapping[str, Any]:
        """The whole parsed JSON object."""
        event = self._event_dict
        if event is None:
            # ``raw`` passed parse_pdu where this PDU was made: the plain
            # decoder gives the same object without the checks' hooks.
            event = json.loads(self.raw)
            object.__setattr__(self, "_event_dict", event)
        return event

    @property
    def content(self) -> Mapping[str, Any]:
        content = self._content
        if content is None:
            content = self.event_dict["content"]
            object.__setattr__(self, "_content", content)
        return content

    def __reduce__(self) -> tuple[Callable[..., ParsedPdu], tuple[Any, ...]]:
        # Pickled (a validation worker's reply) without its dicts: they are
        # most of the pickle and of the receiver's work, which seldom needs
        # them; the room version by its identifier.
        return _unpickled_pdu, (
            self.event_id,
            self.room_id,
            self.sender,
            self.type,
            self.state_key,
            self.depth,
            self.origin_server_ts,
            self.prev_event_ids,
            self.auth_event_ids,
            self.redacts,
            self.membership,
            self.room_version.identifier,
            self.raw,
            self.has_floats,
        )

    def may_hold_key(self, key: str) -> bool:
        """False when the JSON certainly holds no key ``key`` (ASCII) at any
        depth: its bytes spell it nowhere, and no ``\\u`` escape could.
        Lets a reader of one rare key skip decoding ``content``."""
        raw = self.raw
        return key.encode("ascii") in raw or b"\\u" in raw

    @property
    def is_state(self) -> bool:
        """True for state events (those with a ``state_key``)."""
        return self.state_key is not None

    @property
    def is_create(self) -> bool:
        """True for the room's create event (``m.room.create``, state key ``""``)."""
        return self.type == "m.room.create" and self.state_key == ""

    @property
    def auth_chain_event_ids(self) -> tuple[str, ...]:
        """The event's auth events as its auth chain starts: ``auth_events``,
        and from room version 12 the room's create event, which is implied
        and never listed (MSC4291); the create event itself has none."""
        if self.room_version.room_id_is_create_hash and not self.is_create:
            return (*self.auth_event_ids, create_event_id_of(self.room_id))
        return self.auth_event_ids


def _unpickled_pdu(
    event_id: str,
    room_id: str,
    sender: str,
    event_type: str,
    state_key: str | None,
    depth: int,
    origin_server_ts: int,
    prev_event_ids: tuple[str, ...],
    auth_event_ids: tuple[str, ...],
    redacts: str | None,
    membership: str | None,
    room_version_id: str,
    raw: bytes,
    has_floats: bool,
) -> ParsedPdu:
    """``ParsedPdu.__reduce__``'s inverse (the dicts decoded when first asked for)."""
    return ParsedPdu(
        event_id,
        room_id,
        sender,
        event_type,
        state_key,
        depth,
        origin_server_ts,
        prev_event_ids,
        auth_event_ids,
        redacts,
        membership,
        get_room_version(room_version_id),
        raw,
        None,
        None,
        has_floats,
    )


def stored_pdu(raw: bytes, room_version: RoomVersion, event_id: str) -> ParsedPdu:
    """A PDU from bytes :func:`parse_pdu` accepted before (a store's), and
    its known ID: decoded, its fields read, nothing checked or hashed again.
    ``ValueError``/``KeyError``/``TypeError`` where the bytes are not such a PDU."""
    event = json.loads(raw)
    if room_version.event_id_format is EventIdFormat.V1_V2:
        prevs = tuple(p[0] for p in event["prev_events"])
        auths = tuple(a[0] for a in event["auth_events"])
    else:
        prevs, auths = tuple(event["prev_events"]), tuple(event["auth_events"])
    event_type = event["type"]
    content = event["content"]
    room_id = event.get("room_id") or room_id_of_create(event_id)
    return ParsedPdu(
        event_id,
        room_id,
        event["sender"],
        event_type,
        event.get("state_key"),
        event["depth"],
        event["origin_server_ts"],
        prevs,
        auths,
        redacts_of(room_version, event) if event_type == "m.room.redaction" else None,
        content.get("membership") if event_type == "m.room.member" else None,
        room_version,
        raw,
        content,
        event,
    )


def create_event_id_of(room_id: str) -> str:
    """The create event ID of a room version 12 room: ``$`` + its room ID's hash."""
    return "$" + room_id[1:]


def room_id_of_create(create_event_id: str) -> str:
    """The room ID a room version 12 create event makes: ``!`` + its hash."""
    return "!" + create_event_id[1:]


def is_valid_event_id(room_version: RoomVersion, event_id: object) -> bool:
    """True if ``event_id`` is a string in ``room_version``'s ID format."""
    if not isinstance(event_id, str):
        return False
    if len(event_id.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES:
        return False
    return _EVENT_ID_PATTERNS[room_version.event_id_format].fullmatch(event_id) is not None


def parse_pdu(raw: bytes, room_version: RoomVersion) -> ParsedPdu:
    """Validate ``raw`` as a PDU of ``room_version`` and return it parsed.

    For v1/v2 the event ID is the PDU's ``event_id``; for v3+ it is computed
    from the reference hash.  Signatures and content hashes are *not*
    checked here (that needs keys), nor are the authorization rules.

    Raises:
        TypeError: ``raw`` is not ``bytes``.
        InvalidEventError: for any problem with the PDU; the message says which.
    """
    event, has_floats = decoded_event(raw, room_version)

    hashed_room_id = room_version.room_id_is_create_hash
    is_create = event.get("type") == "m.room.create" and event.get("state_key") == ""
    _check_required_keys(event, room_version, is_create)

    room_id = None if hashed_room_id and is_create else _stated_room_id(event, room_version)
    sender = _require_identifier(event, "sender", sigil="@")
    event_type = _require_identifier(event, "type")
    state_key = None
    if "state_key" in event:
        state_key = _require_identifier(event, "state_key")

    content = event["content"]
    if not isinstance(content, dict):
        raise _wrong_type("content", "an object", content)
    origin_server_ts, depth = _timestamp_and_depth(event)
    prev_event_ids = _event_references(event, "prev_events", room_version)
    auth_event_ids = _event_references(event, "auth_events", room_version)
    if room_id is not None and hashed_room_id and create_event_id_of(room_id) in auth_event_ids:
        raise InvalidEventError(
            f"'auth_events' lists the room's create event {create_event_id_of(room_id)}, which "
            f"room version {room_version.identifier} implies and forbids listing",
            "auth_events",
        )
    _check_hashes(event)
    _check_signatures(event)
    if "unsigned" in event and not isinstance(event["unsigned"], dict):
        raise _wrong_type("unsigned", "an object", event["unsigned"])
    if "origin" in event and not isinstance(event["origin"], str):
        raise _wrong_type("origin", "a string", event["origin"])

    event_id = _event_id_of(event, room_version, has_floats)
    for key, cited in (("prev_events", prev_event_ids), ("auth_events", auth_event_ids)):
        if event_id in cited:
            raise InvalidEventError(f"event {event_id} cites itself in {key!r}", key)
    if room_id is None:
        room_id = room_id_of_create(event_id)

    membership, redacts = _membership_and_redacts(event, room_version)

    return ParsedPdu(
        event_id=event_id,
        room_id=room_id,
        sender=sender,
        type=event_type,
        state_key=state_key,
        depth=depth,
        origin_server_ts=origin_server_ts,
        prev_event_ids=prev_event_ids,
        auth_event_ids=auth_event_ids,
        redacts=redacts,
        membership=membership,
        room_version=room_version,
        raw=raw,
        content=content,
        event_dict=event,
        has_floats=has_floats,
    )


def _stated_room_id(event: dict[str, Any], room_version: RoomVersion) -> str:
    """The PDU's ``room_id`` (every event's but a hashed-room-ID version's create event, whose room ID is derived
    from its own event ID): ``!`` and a server part, or in such a version ``!`` and the create event's hash."""
    hashed_room_id = room_version.room_id_is_create_hash
    room_id = _require_identifier(event, "room_id", sigil="" if hashed_room_id else "!")
    if hashed_room_id and not _HASH_ROOM_ID.fullmatch(room_id):
        raise InvalidEventError(
            f"'room_id' must be a room version {room_version.identifier} room ID "
            f"('!' + 43 URL-safe base64 characters, no server part), got {room_id!r}",
            "room_id",
        )
    return room_id


def _timestamp_and_depth(event: dict[str, Any]) -> tuple[int, int]:
    """``origin_server_ts`` (a 64-bit integer) and ``depth`` (0 to ``MAX_DEPTH``), checked."""
    origin_server_ts = _require_int(event, "origin_server_ts")
    if not INT64_MIN <= origin_server_ts <= INT64_MAX:
        raise InvalidEventError(
            f"'origin_server_ts' must be a 64-bit integer (between {INT64_MIN} and {INT64_MAX}), "
            f"got {origin_server_ts}",
            "origin_server_ts",
        )
    depth = _require_int(event, "depth")
    if not 0 <= depth <= MAX_DEPTH:
        raise InvalidEventError(f"'depth' must be between 0 and {MAX_DEPTH}, got {depth}", "depth")
    return origin_server_ts, depth


def _check_required_keys(event: dict[str, Any], room_version: RoomVersion, is_create: bool) -> None:
    """The keys every PDU of ``room_version`` must (or, for a room version
    12 create event, must not) carry."""
    hashed_room_id = room_version.room_id_is_create_hash
    if hashed_room_id and is_create and "room_id" in event:
        raise InvalidEventError(
            f"the m.room.create event of a room version {room_version.identifier} room must not "
            "carry 'room_id': the room ID is '!' + the create event's reference hash",
            "room_id",
        )
    for key in _REQUIRED_KEYS:
        if key not in event and not (key == "room_id" and hashed_room_id and is_create):
            raise InvalidEventError(f"PDU is missing required key {key!r}", key)
    if room_version.event_id_in_pdu and "event_id" not in event:
        raise InvalidEventError(
            f"PDU is missing required key 'event_id' "
            f"(room version {room_version.identifier} carries event IDs in the PDU)",
            "event_id",
        )


def _event_id_of(event: dict[str, Any], room_version: RoomVersion, has_floats: bool) -> str:
    """The PDU's ``event_id`` (v1/v2), checked, or its reference hash (v3+)."""
    event_id: str
    if room_version.event_id_in_pdu:
        event_id = event["event_id"]
        if not is_valid_event_id(room_version, event_id):
            raise InvalidEventError(
                f"'event_id' {event_id!r} is not a room version {room_version.identifier} event ID ('$opaque:server')",
                "event_id",
            )
    else:
        if "event_id" in event:
            raise InvalidEventError(
                f"PDUs in room version {room_version.identifier} must not contain "
                "'event_id': it is computed from the reference hash",
                "event_id",
            )
        try:
            event_id = compute_event_id(room_version, event, floats=has_floats)
        except RecursionError:
            raise InvalidEventError("PDU JSON is nested too deeply") from None
    return event_id


def _membership_and_redacts(event: dict[str, Any], room_version: RoomVersion) -> tuple[str | None, str | None]:
    """(``content.membership`` of a member event, what a redaction redacts), checked."""
    content = event["content"]
    event_type = event["type"]
    membership = None
    if event_type == "m.room.member":
        if "state_key" not in event:
            raise InvalidEventError("m.room.member events must have a 'state_key'", "state_key")
        membership = content.get("membership")
        if not isinstance(membership, str):
            raise _wrong_type("content.membership", "a string", membership)

    redacts = None
    if event_type == "m.room.redaction":
        field = "content.redacts" if room_version.redacts_in_content else "redacts"
        holder = content if room_version.redacts_in_content else event
        if "redacts" in holder:
            redacts = redacts_of(room_version, event)
            if redacts is None:
                raise _wrong_type(field, "a string", holder["redacts"])
    return membership, redacts


def _wrong_type(field: str, expected: str, value: object) -> InvalidEventError:
    return InvalidEventError(f"{field!r} must be {expected}, got {json_type_name(value)}", field)


def _require_identifier(event: Mapping[str, Any], key: str, sigil: str = "") -> str:
    value = event[key]
    if not isinstance(value, str):
        raise _wrong_type(key, "a string", value)
    # A character is at most 4 bytes: only a long string needs encoding.
    if len(value) * 4 > MAX_IDENTIFIER_BYTES and len(value.encode("utf-8")) > MAX_IDENTIFIER_BYTES:
        raise InvalidEventError(f"{key!r} is longer than {MAX_IDENTIFIER_BYTES} bytes", key)
    if sigil and not (value.startswith(sigil) and ":" in value[1:]):
        raise InvalidEventError(f"{key!r} must look like '{sigil}localpart:server', got {value!r}", key)
    return value


def _require_int(event: Mapping[str, Any], key: str) -> int:
    value = event[key]
    # bool is a subclass of int in Python but not an integer in JSON.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong_type(key, "an integer", value)
    return value


def _event_references(event: Mapping[str, Any], key: str, room_version: RoomVersion) -> tuple[str, ...]:
    """Validate ``prev_events``/``auth_events`` and return the event IDs."""
    value = event[key]
    if not isinstance(value, list):
        raise _wrong_type(key, "an array", value)
    fmt = room_version.event_id_format
    if fmt is not EventIdFormat.V1_V2:
        # v3+: every item an ID of exactly 44 ASCII characters, which the
        # pattern alone decides (no length to check); paths only on error.
        fullmatch = (_V4_EVENT_ID if fmt is EventIdFormat.V4_PLUS else _V3_EVENT_ID).fullmatch
        for index, item in enumerate(value):
            if type(item) is not str or fullmatch(item) is None:
                raise _bad_reference(f"{key}[{index}]", item, room_version)
        return tuple(value)
    ids = []
    for index, item in enumerate(value):
        path = f"{key}[{index}]"
        # v1/v2: [event_id, {"sha256": reference hash}]
        if not (isinstance(item, list) and len(item) == 2):
            raise InvalidEventError(
                f"{path!r} must be an [event_id, hashes] pair in room version {room_version.identifier}",
                path,
            )
        event_id, hashes = item
        if not isinstance(hashes, dict):
            raise _wrong_type(f"{path}[1]", "an object of hashes", hashes)
        if not is_valid_event_id(room_version, event_id):
            raise _bad_reference(path, event_id, room_version)
        ids.append(event_id)
    return tuple(ids)


def _bad_reference(path: str, event_id: object, room_version: RoomVersion) -> InvalidEventError:
    return InvalidEventError(
        f"{path!r} is not a room version {room_version.identifier} event ID: {event_id!r}",
        path,
    )


def _check_hashes(event: Mapping[str, Any]) -> None:
    hashes = event["hashes"]
    if not isinstance(hashes, dict):
        raise _wrong_type("hashes", "an object", hashes)
    if not isinstance(hashes.get("sha256"), str):
        raise _wrong_type("hashes.sha256", "a string", hashes.get("sha256"))


def _check_signatures(event: Mapping[str, Any]) -> None:
    signatures = event["signatures"]
    if not isinstance(signatures, dict):
        raise _wrong_type("signatures", "an object", signatures)
    for server, by_key in signatures.items():
        if not isinstance(by_key, dict):
            raise _wrong_type(f"signatures.{server}", "an object", by_key)
        for key_id, signature in by_key.items():
            if not isinstance(signature, str):
                raise _wrong_type(f"signatures.{server}.{key_id}", "a string", signature)
