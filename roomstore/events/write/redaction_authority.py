"""Whether a redaction being stored may redact any event of its room: the
part of its authority known from the redaction alone (``redactions.authorised``).

The rule (Matrix spec, room versions 3 and later, "Handling redactions";
versions 1 and 2 have it as authorization rule 11): a redaction is applied
when its sender has the room's ``redact`` power level in the state before
it, or (v1/v2) when its event ID's server is the redacted event ID's
server. Beside that, this store applies a redaction of its sender's own
event in every version, where the spec says "the sender's domains match":
the stricter reading, so a user of one server cannot blank another user's
message there without the power to (``same_room_redactions`` decides it where
both events are stored, whichever arrived first). An unauthorised redaction
is stored and served as an event, never applied.
"""

from __future__ import annotations

from typing import Any

from roomstore.events.write.auth_checks import state_events
from roomstore.events.write.batch import PreparedEvent
from roomstore.pdu.auth_levels import named_level, user_level

CREATE = ("m.room.create", "")
POWER_LEVELS = ("m.room.power_levels", "")


def redaction_authorised(w: Any, ev: PreparedEvent, group_before: int | None) -> bool:
    """``redactions.authorised`` of the redaction ``ev`` (``w``: the batch
    writer of ``roomstore.events.write.persist``, for its state, its transaction
    and the batch's events, not yet in the tables)."""
    pdu = ev.pdu
    if pdu.room_version.event_id_in_pdu and _server(pdu.event_id) == _server(pdu.redacts or ""):
        return True
    if group_before is None:  # an outlier, or nothing before it: no power to read
        return False
    state = w.state_view(group_before)
    keys = w.p.interners.state_keys.lookup(w.txn, [CREATE, POWER_LEVELS])
    entries = {key: state[keys[key]] for key in (CREATE, POWER_LEVELS) if key in keys and keys[key] in state}
    events = state_events(w, entries)
    version = pdu.room_version
    create = events.get(CREATE)
    if create is None:
        return False
    levels = events.get(POWER_LEVELS)
    # As the auth rules read levels (a v12 creator's is infinite; defaults as Synapse's).
    return user_level(version, create, levels, pdu.sender) >= named_level(version, levels, "redact")


def _server(event_id: str) -> str | None:
    """The server part of a v1/v2 event ID (``$opaque:server``)."""
    _, colon, server = event_id.partition(":")
    return server if colon else None
