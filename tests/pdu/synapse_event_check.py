"""Checks built events with Synapse's own event code; run by
``tests/pdu/test_building.py`` under Synapse's virtualenv (``.venv-synapse``),
never imported by roomstore or its tests.

Reads one JSON object on stdin::

    {"server": "example.org", "seed": "<unpadded base64 ed25519 seed>", "key_version": "a",
     "events": [{"room_version": "10", "event": {...PDU...}}, ...]}

and writes, for each event, what Synapse makes of it::

    {"event_id", "room_id", "content_hash_ok", "signature_ok", "reference_hash", "hashes", "signatures"}

``signature_ok``: Synapse's keyring path (``VerifyJsonRequest.from_event``:
its redaction of the event) verified with ``signedjson``. ``hashes`` and
``signatures``: what Synapse's ``add_hashes_and_signatures`` gives the event
stripped of both, with the same key (ed25519 signatures are deterministic).
"""

from __future__ import annotations

import base64
import json
import sys


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def main() -> None:
    from signedjson.key import decode_signing_key_base64, get_verify_key
    from signedjson.sign import SignatureVerifyException, verify_signed_json
    from synapse.api.room_versions import KNOWN_ROOM_VERSIONS
    from synapse.crypto.event_signing import (
        add_hashes_and_signatures,
        check_event_content_hash,
        compute_event_reference_hash,
    )
    from synapse.crypto.keyring import VerifyJsonRequest
    from synapse.events import make_event_from_dict

    request = json.load(sys.stdin)
    server = request["server"]
    signing_key = decode_signing_key_base64("ed25519", request["key_version"], request["seed"])
    verify_key = get_verify_key(signing_key)
    results = []
    for item in request["events"]:
        room_version = KNOWN_ROOM_VERSIONS[item["room_version"]]
        event = make_event_from_dict(item["event"], room_version)
        signed_json = VerifyJsonRequest.from_event(server, event, 0).get_json_object()
        try:
            verify_signed_json(signed_json, server, verify_key)
            signature_ok = True
        except SignatureVerifyException:
            signature_ok = False
        unsigned_copy = {k: v for k, v in item["event"].items() if k not in ("hashes", "signatures")}
        add_hashes_and_signatures(room_version, unsigned_copy, server, signing_key)
        results.append(
            {
                "event_id": event.event_id,
                "room_id": event.room_id,
                "content_hash_ok": check_event_content_hash(event),
                "signature_ok": signature_ok,
                "reference_hash": b64(compute_event_reference_hash(event)[1]),
                "hashes": unsigned_copy["hashes"],
                "signatures": unsigned_copy["signatures"],
            }
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
