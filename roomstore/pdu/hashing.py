"""Content hashes, reference hashes and event IDs (server-server spec).

* Content hash: sha256 over the canonical JSON of the event with
  ``unsigned``, ``signatures`` and ``hashes`` removed; stored by the sender
  in ``hashes.sha256`` as unpadded standard base64.
* Reference hash: sha256 over the canonical JSON of the *redacted* event with
  ``signatures``, ``unsigned`` and ``age_ts`` removed.
* Event ID (v3+): ``$`` + the reference hash in unpadded base64; standard
  alphabet in v3, URL-safe alphabet from v4.  v1/v2 event IDs are chosen by
  the sender and carried in the PDU, so they cannot be computed.
* Room ID (v12): ``!`` + the create event's reference hash, URL-safe (its
  event ID with ``!`` for ``$``); the create event itself carries none.

:func:`add_derived_ids` puts what a PDU leaves out back into its served form.
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Mapping
from typing import Any

from roomstore.pdu.canonical import canonical_json
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import EventIdFormat, RoomVersion

_URLSAFE = bytes.maketrans(b"+/", b"-_")

__all__ = [
    "add_derived_ids",
    "compute_content_hash",
    "compute_event_id",
    "compute_reference_hash",
    "unpadded_base64",
]


def unpadded_base64(data: bytes, *, urlsafe: bool = False) -> str:
    """Encode ``data`` as the spec's unpadded base64 (optionally URL-safe)."""
    encoded = binascii.b2a_base64(data, newline=False).rstrip(b"=")
    if urlsafe:
        encoded = encoded.translate(_URLSAFE)
    return encoded.decode("ascii")


def compute_content_hash(event_dict: Mapping[str, Any], *, floats: bool = True) -> str:
    """Return the content hash of ``event_dict`` as unpadded standard base64.

    This is the value a sender puts in ``hashes.sha256``.  The input is not
    modified. ``floats=False``: ``event_dict`` holds no float (see
    ``canonical_json``).
    """
    stripped = {k: v for k, v in event_dict.items() if k not in ("unsigned", "signatures", "hashes")}
    return unpadded_base64(hashlib.sha256(canonical_json(stripped, floats=floats)).digest())


def compute_reference_hash(room_version: RoomVersion, event_dict: Mapping[str, Any], *, floats: bool = True) -> bytes:
    """Return the 32-byte sha256 reference hash of ``event_dict``."""
    # Only serialised, never kept: no need to deep-copy what survives.
    redacted = prune_event_dict(room_version, event_dict, deep_copy=False)
    # The redaction algorithm already drops all three in every version; the
    # spec lists the step explicitly, so we do it too rather than rely on that.
    for key in ("signatures", "unsigned", "age_ts"):
        redacted.pop(key, None)
    return hashlib.sha256(canonical_json(redacted, floats=floats)).digest()


def compute_event_id(room_version: RoomVersion, event_dict: Mapping[str, Any], *, floats: bool = True) -> str:
    """Return the event ID of a v3+ event, computed from its reference hash.

    Raises:
        ValueError: ``room_version`` is v1 or v2, whose event IDs are not
            derived from the event's contents.
    """
    fmt = room_version.event_id_format
    if fmt is EventIdFormat.V1_V2:
        raise ValueError(
            f"room version {room_version.identifier} carries event IDs in the PDU; they cannot be computed"
        )
    digest = compute_reference_hash(room_version, event_dict, floats=floats)
    return "$" + unpadded_base64(digest, urlsafe=fmt is EventIdFormat.V4_PLUS)


def add_derived_ids(event: dict[str, Any], event_id: str, room_version: RoomVersion | None) -> dict[str, Any]:
    """Complete the served form of a stored event, in place: ``event_id``
    where the PDU does not carry it (v3+), and the ``room_id`` of a room
    version 12 create event (``!`` + its hash), which its PDU must not carry
    and Synapse adds back when serving it. Keys present are left alone.
    Returns ``event``."""
    event.setdefault("event_id", event_id)
    if (
        room_version is not None
        and room_version.room_id_is_create_hash
        and event.get("type") == "m.room.create"
        and event.get("state_key") == ""
    ):
        event.setdefault("room_id", "!" + event_id[1:])
    return event
