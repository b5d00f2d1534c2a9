"""Event signatures, checked where the signing servers' keys are at hand
(``RoomStore.persist_events(verify_keys=...)``; ``roomstore import --keys FILE``).

The keys file is a JSON object, server name -> that server's verify keys,
each either a map of key ID to the unpadded base64 public key::

    {"example.org": {"ed25519:a": "VGhpcyBpcyAzMiBieXRlcyBvZiBwdWJsaWMga2V5ISE"}}

or the server's own key response (``GET /_matrix/key/v2/server``), whose
``verify_keys`` and ``old_verify_keys`` are read::

    {"example.org": {"server_name": "example.org", "verify_keys": {"ed25519:a": {"key": "..."}}, ...}}

What is checked (server-server spec, "Validating hashes and signatures on
received events"): the signature of the sender's server, and in room versions
1 and 2 of the server named in the event ID, over the redacted event. A
server whose keys are given must have signed with one of them and the
signature must verify, else the event is refused (``InvalidSignature``). An
event needing a server whose keys are not given, or signed only with key IDs
the file does not list, is stored with its signatures *unchecked*
(``PersistedEvent.signatures_checked`` False).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

import attrs
from signedjson.key import decode_verify_key_bytes
from signedjson.sign import SignatureVerifyException, verify_signed_json

from roomstore.pdu.parsing import InvalidEventError, ParsedPdu
from roomstore.pdu.redaction_algorithm import prune_event_dict

__all__ = ["InvalidSignature", "KeysFileError", "VerifyKeys", "load_verify_keys", "signatures_checked"]


class InvalidSignature(InvalidEventError):
    """A server whose keys are known signed the event wrongly, or not at all."""


class KeysFileError(ValueError):
    """The keys file cannot be read as the documented format; the message says where."""


@attrs.frozen
class VerifyKeys:
    """Server name -> key ID -> verify key (signedjson's ``VerifyKey``)."""

    servers: Mapping[str, Mapping[str, Any]]

    @classmethod
    def from_json(cls, obj: Any, where: str = "keys") -> VerifyKeys:
        if not isinstance(obj, dict):
            raise KeysFileError(f"{where}: must be a JSON object of server name -> verify keys")
        servers: dict[str, dict[str, Any]] = {}
        for server, keys in obj.items():
            if isinstance(keys, dict) and ("verify_keys" in keys or "old_verify_keys" in keys):
                listed = {
                    **_response_keys(keys.get("old_verify_keys"), f"{where}: {server}.old_verify_keys"),
                    **_response_keys(keys.get("verify_keys"), f"{where}: {server}.verify_keys"),
                }
            elif isinstance(keys, dict):
                listed = keys
            else:
                raise KeysFileError(f"{where}: {server}: must be an object of key ID -> base64 key")
            servers[server] = {}
            for key_id, key in listed.items():
                if not isinstance(key, str) or ":" not in key_id:
                    raise KeysFileError(f'{where}: {server}: {key_id}: want "ed25519:ID": "<unpadded base64 key>"')
                try:
                    servers[server][key_id] = decode_verify_key_bytes(key_id, decode_base64(key))
                except Exception as exc:  # bad base64, unknown algorithm, wrong length
                    raise KeysFileError(f"{where}: {server}: {key_id}: not a verify key ({exc})") from None
        return cls(servers)


def decode_base64(text: str) -> bytes:
    """Unpadded (or padded) standard or URL-safe base64, strictly."""
    text = text.rstrip("=")
    padded = text + "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(padded)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"bad base64: {exc}") from None


def _response_keys(keys: Any, where: str) -> dict[str, Any]:
    if keys is None:
        return {}
    if not isinstance(keys, dict) or not all(isinstance(v, dict) and "key" in v for v in keys.values()):
        raise KeysFileError(f'{where}: want {{"ed25519:ID": {{"key": "<unpadded base64 key>"}}}}')
    return {key_id: value["key"] for key_id, value in keys.items()}


def load_verify_keys(path: str) -> VerifyKeys:
    """The keys file at ``path`` (format above); ``KeysFileError`` or ``OSError``."""
    with open(path, "rb") as handle:
        try:
            obj = json.loads(handle.read().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise KeysFileError(f"{path}: not JSON: {exc}") from None
    return VerifyKeys.from_json(obj, path)


def _server_of(identifier: str) -> str:
    return identifier.split(":", 1)[1] if ":" in identifier else ""


def signatures_checked(pdu: ParsedPdu, keys: VerifyKeys) -> bool:
    """True if every server that must sign ``pdu`` was checked (see the module
    docstring), False if one of them could not be (keys not at hand);
    ``InvalidSignature`` if a check failed."""
    needed = {_server_of(pdu.sender)}
    if pdu.room_version.event_id_in_pdu:
        needed.add(_server_of(pdu.event_id))
    signatures = pdu.event_dict.get("signatures")
    redacted = None
    complete = True
    for server in sorted(needed):
        known = keys.servers.get(server)
        if not known:
            complete = False
            continue
        signed = signatures.get(server) if isinstance(signatures, dict) else None
        if not isinstance(signed, dict) or not signed:
            raise InvalidSignature(f"event {pdu.event_id}: not signed by {server}")
        usable = [known[key_id] for key_id in sorted(signed) if key_id in known]
        if not usable:
            complete = False  # signed with keys we were not given (older or newer ones)
            continue
        if redacted is None:
            redacted = prune_event_dict(pdu.room_version, pdu.event_dict)
        for verify_key in usable:
            try:
                verify_signed_json(redacted, server, verify_key)
            except SignatureVerifyException:
                raise InvalidSignature(
                    f"event {pdu.event_id}: bad signature by {server} ({verify_key.alg}:{verify_key.version})"
                ) from None
    return complete
