"""Builders for valid PDUs of each room version, shared by the event tests."""

from __future__ import annotations

import json
from typing import Any

from canonicaljson import encode_canonical_json

from roomstore.pdu.hashing import compute_content_hash
from roomstore.pdu.room_versions import EventIdFormat, RoomVersion

# 43 characters of base64 in each alphabet, for well-formed references.
V3_REF = "$" + "A+/" + "b" * 40
V4_REF = "$" + "A-_" + "b" * 40
V1_REF = "$abcdef:example.org"
#: A room version 12 room ID ("!" + a create event's hash; no such event here).
V12_ROOM = "!" + "r00m-_" + "d" * 37


def reference_for(room_version: RoomVersion, n: int = 0) -> Any:
    """A well-formed prev/auth event reference in ``room_version``'s format."""
    fmt = room_version.event_id_format
    if fmt is EventIdFormat.V1_V2:
        return [f"$ref{n}:example.org", {"sha256": "aGFzaA"}]
    if fmt is EventIdFormat.V3:
        return "$" + f"{n:03d}+/" + "c" * 38
    return "$" + f"{n:03d}-_" + "c" * 38


def make_pdu(room_version: RoomVersion, **overrides: Any) -> dict[str, Any]:
    """Return a valid PDU dict for ``room_version``.

    Keyword arguments replace top-level keys; pass ``_drop=("key", ...)`` to
    remove keys.  The content hash is recomputed after overrides unless
    ``hashes`` was overridden.
    """
    drop = overrides.pop("_drop", ())
    pdu: dict[str, Any] = {
        "room_id": V12_ROOM if room_version.room_id_is_create_hash else "!room:example.org",
        "sender": "@alice:example.org",
        "type": "m.room.message",
        "content": {"msgtype": "m.text", "body": "hello"},
        "origin_server_ts": 1_700_000_000_000,
        "depth": 12,
        "prev_events": [reference_for(room_version, 1)],
        "auth_events": [reference_for(room_version, 2), reference_for(room_version, 3)],
        "hashes": {"sha256": "placeholder"},
        "signatures": {"example.org": {"ed25519:a_key": "c2lnbmF0dXJl"}},
        "unsigned": {"age_ts": 1_700_000_000_000},
    }
    if room_version.event_id_in_pdu:
        pdu["event_id"] = "$message1:example.org"
    pdu.update(overrides)
    for key in drop:
        pdu.pop(key, None)
    if "hashes" not in overrides and "hashes" not in drop:
        pdu["hashes"] = {"sha256": compute_content_hash(pdu)}
    return pdu


def encode(pdu: dict[str, Any]) -> bytes:
    """Canonical JSON bytes of ``pdu``."""
    return encode_canonical_json(pdu)


def encode_loose(pdu: dict[str, Any]) -> bytes:
    """Non-canonical JSON (spaces, insertion order, ASCII escapes)."""
    return json.dumps(pdu, indent=1, ensure_ascii=True).encode("ascii")
