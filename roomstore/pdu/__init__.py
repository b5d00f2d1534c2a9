"""Pure PDU code: room versions, parsing and validation, hashes, signatures,
content hashes, the redaction algorithm, power levels and the authorization
rules (``auth_rules``).

Nothing here touches a database, a stream or the store: each module imports
only the standard library, its third-party helpers and other modules of this
package.  ``roomstore.events`` re-exports the names embedders use.

Building events (``building``), exported here: :func:`build_event` lays out,
hashes, signs (the room version's redacted form of the event, as the spec
says) and names an event of any room version, 1 to 12, into a
:class:`BuiltPdu` whose ``raw`` bytes ``RoomStore.persist_events`` takes
(``EventToPersist(built.raw, room_version)``); in room version 12 the create
event's ``BuiltPdu.room_id`` is the room's ID. Bad arguments raise
:class:`EventBuildError` (a ``ValueError``), with a one-line message.
docs/api.md ("Building events") shows it.
"""

from roomstore.pdu.building import BuiltPdu, EventBuildError, build_event

__all__ = ["BuiltPdu", "EventBuildError", "build_event"]
