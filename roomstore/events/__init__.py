from roomstore.events.tokens import (
    InvalidToken,
    StreamToken,
    TopologicalToken,
    parse_token,
)
from roomstore.pdu.hashing import (
    compute_content_hash,
    compute_event_id,
    compute_reference_hash,
)
from roomstore.pdu.parsing import (
    MAX_PDU_SIZE,
    InvalidEventError,
    ParsedPdu,
    parse_pdu,
)
from roomstore.pdu.redaction_algorithm import prune_event_dict, redacted_copy, redacts_of
from roomstore.pdu.room_versions import (
    KNOWN_ROOM_VERSIONS,
    EventIdFormat,
    RoomVersion,
    RoomVersions,
    UnknownRoomVersion,
    get_room_version,
)

__all__ = [
    "EventIdFormat",
    "InvalidEventError",
    "InvalidToken",
    "KNOWN_ROOM_VERSIONS",
    "MAX_PDU_SIZE",
    "ParsedPdu",
    "RoomVersion",
    "RoomVersions",
    "StreamToken",
    "TopologicalToken",
    "UnknownRoomVersion",
    "compute_content_hash",
    "compute_event_id",
    "compute_reference_hash",
    "get_room_version",
    "parse_pdu",
    "parse_token",
    "prune_event_dict",
    "redacted_copy",
    "redacts_of",
]
