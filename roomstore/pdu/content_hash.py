"""The content-hash check every persisted event passes (server-server spec,
"Checks performed on receipt of a PDU": a PDU whose content hash does not
match is redacted before it is processed further).

``checked_pdu`` is called by ``prepare_events`` (``events/write/batch.py``), so
every way into the store (``RoomStore.persist_events``: ``import``, ``demo``,
``import --redis``, an embedding homeserver) goes through it.

What is stored for an event that fails the check:

* the bytes are the canonical JSON of the room version's redaction of the
  event as received (``prune_event_dict``), not the bytes received: only the
  redacted form is known to be what the sender signed;
* the event ID does not change: in v3+ it is the reference hash, which is
  computed over the redacted form, so the redacted event has the same ID
  (checked, not assumed); in v1/v2 the PDU's ``event_id`` survives redaction;
* ``event_json.censored`` is TRUE while ``events.redacted`` is FALSE: the
  stored JSON is the redacted form though no redaction event names it
  (docs/schema.md); the event then takes part in state and timelines as its
  redacted form, as the spec's rule says.
"""

from __future__ import annotations

from canonicaljson import encode_canonical_json

from roomstore.pdu.hashing import compute_content_hash
from roomstore.pdu.parsing import InvalidEventError, ParsedPdu, parse_pdu
from roomstore.pdu.redaction_algorithm import prune_event_dict

__all__ = ["ContentHashMismatch", "checked_pdu", "content_hash_matches"]


class ContentHashMismatch(InvalidEventError):
    """An event's ``hashes.sha256`` is not the hash of its content, and the
    caller asked for such events to be refused (``import --strict``)."""

    def __init__(self, event_id: str) -> None:
        super().__init__(f"event {event_id}: content hash mismatch", "hashes.sha256")
        self.event_id = event_id


def content_hash_matches(pdu: ParsedPdu) -> bool:
    """Whether the PDU's ``hashes.sha256`` is the hash of what it carries."""
    claimed: object = pdu.event_dict["hashes"]["sha256"]
    return claimed == compute_content_hash(pdu.event_dict, floats=pdu.has_floats)


def checked_pdu(pdu: ParsedPdu, refuse: bool = False) -> tuple[ParsedPdu, bool]:
    """(the PDU to store, whether its content hash failed).

    A good PDU is returned as it is (its bytes exactly as received). A failing
    one is returned redacted (see the module docstring) or, with ``refuse``,
    raises ``ContentHashMismatch``.
    """
    if content_hash_matches(pdu):
        return pdu, False
    if refuse:
        raise ContentHashMismatch(pdu.event_id)
    redacted = encode_canonical_json(prune_event_dict(pdu.room_version, pdu.event_dict))
    stored = parse_pdu(redacted, pdu.room_version)
    if stored.event_id != pdu.event_id:  # the redaction algorithm is idempotent: never expected
        raise InvalidEventError(
            f"event {pdu.event_id}: content hash mismatch, and its redacted form has another ID ({stored.event_id})"
        )
    return stored, True
