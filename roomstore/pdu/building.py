"""Building a signed PDU of any room version: :func:`build_event`.

The recipe (server-server spec, "Signing events" and "Calculating the
reference hash for an event"), in the order it must run:

1. **Lay out** the PDU: ``room_id`` (none on a room version 12 create event),
   ``sender``, ``type``, ``state_key``, ``content``, ``depth``,
   ``origin_server_ts``, ``prev_events`` and ``auth_events`` (in room versions 1
   and 2 ``[event_id, {"sha256": reference hash}]`` pairs, later plain IDs),
   ``redacts`` for a redaction (top level before v11, in ``content`` from v11),
   and in room versions 1 and 2 the ``event_id`` the sending server chose.
2. **Hash**: ``hashes.sha256`` is the content hash, over the whole event but
   ``unsigned``, ``signatures`` and ``hashes`` (:func:`~roomstore.pdu.hashing.compute_content_hash`).
3. **Prune and sign**: the signature is over the room version's *redacted*
   form of the hashed event (:func:`~roomstore.pdu.redaction_algorithm.prune_event_dict`),
   never the whole event, so that it still verifies once the event is redacted;
   receivers check it on that form too (``roomstore.pdu.signatures``). It goes
   into the full event's ``signatures`` under the sender's server name.
   Signing the full event gives a signature no receiver accepts
   (``InvalidSignature``).
4. **Name**: in room versions 3 and later the event ID is ``$`` + the reference
   hash (sha256 of the redacted, signature-less event; standard base64 in v3,
   URL-safe from v4) (:func:`~roomstore.pdu.hashing.compute_event_id`), so it is
   known only now; the signature does not change it (signatures are left out of
   the reference hash). In room version 12 the create event's room ID is that
   ID with ``!`` for ``$``, and every later event of the room carries it.

``unsigned``, if given, is added last: it is covered by neither hash nor
signature.

The result is checked by :func:`~roomstore.pdu.parsing.parse_pdu`, the gate
every persisted event passes, so a :class:`BuiltPdu` is one the store accepts
(its ``raw`` goes to ``EventToPersist(raw, room_version)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from signedjson.sign import sign_json

from roomstore.pdu.canonical import canonical_json
from roomstore.pdu.hashing import compute_content_hash, compute_reference_hash, unpadded_base64
from roomstore.pdu.json_decoding import InvalidEventError
from roomstore.pdu.parsing import create_event_id_of, is_valid_event_id, parse_pdu, room_id_of_create
from roomstore.pdu.redaction_algorithm import copy_json, prune_event_dict
from roomstore.pdu.room_versions import RoomVersion, get_room_version

__all__ = ["BuiltPdu", "EventBuildError", "build_event"]


class EventBuildError(InvalidEventError):
    """:func:`build_event` was given something it cannot build a valid PDU
    from; the one-line message says what, ``field`` names the argument."""


@attrs.frozen(eq=False)
class BuiltPdu:
    """A PDU :func:`build_event` built, hashed, signed and named.

    Compared by identity (``eq=False``): ``event`` is a dict. Treat it as
    read-only: ``raw`` is its encoding.
    """

    #: The event's ID: chosen by the server in room versions 1 and 2 (and
    #: carried in the PDU), the reference hash from room version 3.
    event_id: str
    #: The canonical JSON of ``event``: what ``EventToPersist(raw,
    #: room_version)`` takes, and what goes over federation.
    raw: bytes
    #: The PDU as a dict (no ``event_id`` from room version 3; a room version
    #: 12 create event has no ``room_id``).
    event: dict[str, Any]
    room_version: RoomVersion = attrs.field(repr=lambda v: f"<room version {v.identifier}>")
    #: The reference hash, unpadded standard base64: what room versions 1 and
    #: 2 cite next to the event ID in ``prev_events`` and ``auth_events``.
    reference_hash: str

    @property
    def room_id(self) -> str:
        """The event's room; for a room version 12 create event, the room ID
        it makes (``!`` + its hash), which later events of the room carry."""
        room_id = self.event.get("room_id")
        return room_id if isinstance(room_id, str) else room_id_of_create(self.event_id)


#: An event cited in ``prev_events``/``auth_events`` or named by ``redacts``:
#: its ID, or the :class:`BuiltPdu` (which also carries its reference hash).
EventRef = str | BuiltPdu


def build_event(
    room_version: str | RoomVersion,
    *,
    room_id: str | None,
    sender: str,
    type: str,
    content: Mapping[str, Any],
    state_key: str | None = None,
    prev_events: Sequence[EventRef],
    auth_events: Sequence[EventRef],
    depth: int,
    origin_server_ts: int,
    signing_key: Any,
    origin: str | None = None,
    redacts: EventRef | None = None,
    unsigned: Mapping[str, Any] | None = None,
    event_id: str | None = None,
    reference_hashes: Mapping[str, str] | None = None,
) -> BuiltPdu:
    """Build, hash, sign (the pruned form) and name one event (module docstring).

    Args:
        room_version: an identifier (``"1"`` ... ``"12"``) or a ``RoomVersion``.
        room_id: the room; None for (and only for) a room version 12 create
            event (``m.room.create``, state key ``""``), whose room ID is its
            hash: later events pass that create event's ``BuiltPdu.room_id``.
        sender: ``@user:server``; the event is signed as ``server``.
        type, content, state_key: the event's; ``state_key`` None for a
            non-state event. ``content`` is copied, never kept.
        prev_events, auth_events: the events cited, each an event ID or a
            ``BuiltPdu``. Room versions 1 and 2 cite the reference hash as
            well: a ``BuiltPdu`` carries it, an ID needs it in
            ``reference_hashes``. Room version 12 never lists the create event
            in ``auth_events`` (it is implied).
        depth, origin_server_ts: integers, as the PDU carries them.
        signing_key: the sender's server's signing key, a signedjson
            ``SigningKey`` (``signedjson.key.generate_signing_key(version)`` or
            ``read_signing_keys``); the key ID is ``alg:version``.
        origin: the PDU's optional top-level ``origin`` (left out when None,
            as current servers do; only room versions 1-10 protect it from
            redaction).
        redacts: for an ``m.room.redaction``: the event it redacts (an ID or a
            ``BuiltPdu``); put at the top level before room version 11, in
            ``content`` from 11. Required there unless a v11+ ``content``
            already holds it; refused on any other type.
        unsigned: the PDU's ``unsigned``, outside hashes and signatures.
        event_id: room versions 1 and 2 only: the ID to carry, of the
            sender's server; default ``$`` + 18 URL-safe characters of the
            event's content hash + ``:server``.
        reference_hashes: event ID -> reference hash (unpadded base64), for
            room version 1 and 2 citations given as IDs.

    Raises:
        UnknownRoomVersion: ``room_version`` is not one of 1-12 (a ValueError).
        EventBuildError: an argument cannot make a valid PDU (the message
            says which and why).
        InvalidEventError: the built PDU fails ``parse_pdu`` (for instance it
            is over 65,536 bytes, or holds a float in room version 6+).
    """
    version = room_version if isinstance(room_version, RoomVersion) else get_room_version(room_version)
    server = _server_of(sender)
    room_id = _checked_fields(version, room_id, type, state_key, content, depth, origin_server_ts, unsigned, origin)
    key_id = _key_id(signing_key)
    event: dict[str, Any] = {
        "auth_events": _citations(version, room_id, "auth_events", auth_events, reference_hashes),
        "content": copy_json(content),
        "depth": depth,
        "origin_server_ts": origin_server_ts,
        "prev_events": _citations(version, room_id, "prev_events", prev_events, reference_hashes),
        "sender": sender,
        "type": type,
    }
    optional = {"room_id": room_id, "state_key": state_key, "origin": origin}
    event.update((name, value) for name, value in optional.items() if value is not None)
    _place_redacts(version, event, redacts)
    _check_implied_create(version, room_id, event["auth_events"])
    _place_event_id(version, event, event_id, server)
    return _hashed_and_signed(version, event, server, signing_key, key_id, unsigned)


def _hashed_and_signed(
    version: RoomVersion,
    event: dict[str, Any],
    server: str,
    signing_key: Any,
    key_id: str,
    unsigned: Mapping[str, Any] | None,
) -> BuiltPdu:
    """The event's content hash, its server's signature of the pruned form,
    ``unsigned`` outside both, and its name: the built PDU."""
    event["hashes"] = {"sha256": compute_content_hash(event)}
    signed = sign_json(prune_event_dict(version, event), server, signing_key)
    event["signatures"] = {server: {key_id: signed["signatures"][server][key_id]}}
    if unsigned is not None:
        event["unsigned"] = copy_json(unsigned)
    raw = canonical_json(event)
    pdu = parse_pdu(raw, version)  # names v3+ events (compute_event_id) and checks what the store checks
    reference_hash = unpadded_base64(compute_reference_hash(version, event))
    return BuiltPdu(pdu.event_id, raw, event, version, reference_hash)


# ------------------------------------------------------------ the checks


def _checked_fields(
    version: RoomVersion,
    room_id: str | None,
    event_type: object,
    state_key: object,
    content: object,
    depth: object,
    origin_server_ts: object,
    unsigned: object,
    origin: object,
) -> str | None:
    """``build_event``'s plain arguments checked (``EventBuildError`` naming
    the first that cannot make a valid PDU); returns the room ID to carry."""
    _check_str("type", event_type)
    if state_key is not None:
        _check_str("state_key", state_key)
    is_create = event_type == "m.room.create" and state_key == ""
    checked_room_id = _checked_room_id(version, room_id, is_create)
    _check_int("depth", depth)
    _check_int("origin_server_ts", origin_server_ts)
    if not isinstance(content, Mapping):
        raise EventBuildError(f"content must be a JSON object (a mapping), got {_kind(content)}", "content")
    if is_create and content.get("room_version", "1") != version.identifier:
        # The spec's default is "1"; the store files the room under the version it is given.
        raise EventBuildError(
            f"content.room_version {content.get('room_version', '1 (by default)')!r} of a create event built "
            f"as room version {version.identifier}",
            "content",
        )
    if unsigned is not None and not isinstance(unsigned, Mapping):
        raise EventBuildError(f"unsigned must be a JSON object (a mapping), got {_kind(unsigned)}", "unsigned")
    if origin is not None:
        _check_str("origin", origin)
    return checked_room_id


def _check_implied_create(version: RoomVersion, room_id: str | None, auth_events: Sequence[Any]) -> None:
    """Room version 12 implies the create event: listing it in ``auth_events`` is refused."""
    if version.room_id_is_create_hash and room_id is not None:
        implied = create_event_id_of(room_id)
        if any(cited == implied for cited in auth_events):
            raise EventBuildError(
                f"auth_events lists the room's create event {implied}: room version "
                f"{version.identifier} implies it and forbids listing it",
                "auth_events",
            )


def _kind(value: object) -> str:
    return value.__class__.__name__


def _check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise EventBuildError(f"{name} must be a string, got {_kind(value)}", name)
    return value


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EventBuildError(f"{name} must be an integer, got {_kind(value)}", name)


def _server_of(sender: object) -> str:
    if not isinstance(sender, str) or not sender.startswith("@") or ":" not in sender[1:]:
        raise EventBuildError(f"sender must look like '@localpart:server', got {sender!r}", "sender")
    return sender.split(":", 1)[1]


def _key_id(signing_key: object) -> str:
    alg, key_version = getattr(signing_key, "alg", None), getattr(signing_key, "version", None)
    if not (isinstance(alg, str) and isinstance(key_version, str) and callable(getattr(signing_key, "sign", None))):
        raise EventBuildError(
            "signing_key must be a signedjson signing key (signedjson.key.generate_signing_key(version)), "
            f"got {_kind(signing_key)}",
            "signing_key",
        )
    return f"{alg}:{key_version}"


def _checked_room_id(version: RoomVersion, room_id: object, is_create: bool) -> str | None:
    """``room_id`` as the PDU carries it: None only for a v12 create event."""
    v = version.identifier
    if version.room_id_is_create_hash:
        if is_create:
            if room_id is not None:
                raise EventBuildError(
                    f"a room version {v} create event carries no room_id (the room ID is '!' + its "
                    f"hash): pass room_id=None, got {room_id!r}",
                    "room_id",
                )
            return None
        if room_id is None:
            raise EventBuildError(
                f"room_id is None: a room version {v} room's ID is '!' + its create event's hash; "
                "build the create event first and pass its BuiltPdu.room_id",
                "room_id",
            )
        room_id = _check_str("room_id", room_id)
        if not is_valid_event_id(version, create_event_id_of(room_id)) or not room_id.startswith("!"):
            raise EventBuildError(
                f"room_id {room_id!r} is not a room version {v} room ID ('!' + the create event's hash, "
                "43 URL-safe base64 characters): pass the create event's BuiltPdu.room_id",
                "room_id",
            )
        return room_id
    if room_id is None:
        raise EventBuildError(f"room_id is None: room version {v} events carry their room's ID", "room_id")
    if not isinstance(room_id, str) or not room_id.startswith("!") or ":" not in room_id[1:]:
        raise EventBuildError(f"room_id must look like '!opaque:server', got {room_id!r}", "room_id")
    return room_id


def _ref_id(version: RoomVersion, room_id: str | None, where: str, ref: object) -> str:
    """The ID of a cited event, checked (format; a BuiltPdu's version and room)."""
    v = version.identifier
    if isinstance(ref, BuiltPdu):
        if ref.room_version != version:
            raise EventBuildError(
                f"{where}: event {ref.event_id} is a room version {ref.room_version.identifier} event, "
                f"this is room version {v}",
                where.split("[")[0],
            )
        if room_id is not None and ref.room_id != room_id:
            raise EventBuildError(
                f"{where}: event {ref.event_id} is in room {ref.room_id}, not {room_id}", where.split("[")[0]
            )
        return ref.event_id
    if not is_valid_event_id(version, ref):
        raise EventBuildError(
            f"{where}: {ref!r} is not a room version {v} event ID (or a BuiltPdu)", where.split("[")[0]
        )
    return ref  # type: ignore[return-value]  # is_valid_event_id: a str


def _citations(
    version: RoomVersion, room_id: str | None, name: str, refs: object, reference_hashes: Mapping[str, str] | None
) -> list[Any]:
    """``prev_events``/``auth_events`` in the version's format."""
    if isinstance(refs, (str, bytes, BuiltPdu)) or not isinstance(refs, Sequence):
        raise EventBuildError(f"{name} must be a list of event IDs or BuiltPdus, got {_kind(refs)}", name)
    cited: list[Any] = []
    for index, ref in enumerate(refs):
        event_id = _ref_id(version, room_id, f"{name}[{index}]", ref)
        if not version.event_id_in_pdu:
            cited.append(event_id)
            continue
        reference_hash: str | None
        if isinstance(ref, BuiltPdu):
            reference_hash = ref.reference_hash
        else:
            reference_hash = (reference_hashes or {}).get(event_id)
            if not isinstance(reference_hash, str):
                raise EventBuildError(
                    f"{name}[{index}]: room version {version.identifier} cites {event_id} with its reference "
                    "hash: pass its BuiltPdu, or the hash in reference_hashes",
                    name,
                )
        cited.append([event_id, {"sha256": reference_hash}])
    return cited


def _place_redacts(version: RoomVersion, event: dict[str, Any], redacts: object) -> None:
    """``redacts`` where the version keeps it (top level before v11, content from v11)."""
    is_redaction = event["type"] == "m.room.redaction"
    if redacts is None:
        if is_redaction and not (version.redacts_in_content and "redacts" in event["content"]):
            raise EventBuildError("an m.room.redaction needs redacts= (the event it redacts)", "redacts")
        return
    if not is_redaction:
        raise EventBuildError(
            f"redacts is given for an event of type {event['type']!r}: only m.room.redaction events redact", "redacts"
        )
    target = _ref_id(version, event.get("room_id"), "redacts", redacts)
    if not version.redacts_in_content:
        event["redacts"] = target
        return
    already = event["content"].get("redacts", target)
    if already != target:
        raise EventBuildError(f"redacts={target!r} but content.redacts is {already!r}", "redacts")
    event["content"]["redacts"] = target


def _place_event_id(version: RoomVersion, event: dict[str, Any], event_id: str | None, server: str) -> None:
    """Room versions 1 and 2 carry their ID (chosen, or given); later ones
    are named by their reference hash and refuse one given."""
    if version.event_id_in_pdu:
        event["event_id"] = _chosen_event_id(version, event, event_id, server)
    elif event_id is not None:
        raise EventBuildError(
            f"event_id is given, but room version {version.identifier} names events by their "
            "reference hash (only versions 1 and 2 carry a chosen ID)",
            "event_id",
        )


def _chosen_event_id(version: RoomVersion, event: dict[str, Any], event_id: str | None, server: str) -> str:
    """A room version 1/2 event's own ID: given, or derived from its content hash."""
    if event_id is None:
        localpart = compute_content_hash(event).translate(_URLSAFE)[:18]
        return f"${localpart}:{server}"
    if not is_valid_event_id(version, event_id):
        raise EventBuildError(
            f"event_id {event_id!r} is not a room version {version.identifier} event ID ('$opaque:server')", "event_id"
        )
    if event_id.split(":", 1)[1] != server:
        raise EventBuildError(
            f"event_id {event_id!r} names another server than the sender's ({server}), which signs it: "
            "receivers would want that server's signature too",
            "event_id",
        )
    return event_id


_URLSAFE = str.maketrans("+/", "-_")
