"""A batch to persist, as given and as validated: the value classes and the
steps before any transaction (room versions, parsing, ordering).

``EventToPersist``, ``ClientTxn``, ``StateDelta`` and ``PersistedEvent`` are the
public face of ``RoomStore.persist_events`` (re-exported by
``roomstore.events.write.persist``);
``prepare_events`` validates a batch on the reactor, ``order_batch`` puts each
event after its prev events in the batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

import attrs

from roomstore.pdu.content_hash import checked_pdu
from roomstore.pdu.json_decoding import quick_json
from roomstore.pdu.parsing import MAX_JSON_NESTING, MAX_PDU_SIZE, InvalidEventError, ParsedPdu, parse_pdu
from roomstore.pdu.room_versions import get_room_version
from roomstore.pdu.signatures import VerifyKeys, signatures_checked

StateKey = tuple[str, str]


@attrs.frozen
class StateDelta:
    """State given as changes against a state group the store returned earlier."""

    base_state_group: int
    changes: Mapping[StateKey, str] = attrs.field(factory=dict)


@attrs.frozen
class ClientTxn:
    """The client transaction an event was sent in (``PUT
    /rooms/{roomId}/send/{eventType}/{txnId}``): recorded with the event so
    that a retried request finds the event it made
    (``RoomStore.get_event_id_for_txn``)."""

    user_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    device_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    txn_id: str = attrs.field(validator=attrs.validators.instance_of(str))

    def __reduce__(self):
        # Pickled with its event (validation workers, the writer process).
        return ClientTxn, (self.user_id, self.device_id, self.txn_id)


@attrs.frozen
class EventToPersist:
    """One event of a batch, as a homeserver hands it over.

    ``raw`` is the PDU exactly as received. ``room_version`` may be left out
    when the room's create event is stored or earlier in the batch.
    ``state_before`` is the state before the event: a full map of
    ``(type, state_key) -> event_id``, a ``StateDelta``, or None to derive it
    from the prev events.

    The store checks every event against the room's authorization rules and
    stores one that fails them rejected (``roomstore.events.write.auth_checks``).
    ``rejected_reason`` given: the caller decided, and the event is stored
    rejected for that reason unchecked. ``auth_checked``: the event's source
    checked it already (an import from a homeserver's database): stored as
    given, unchecked. Set it only for such a source.

    ``client_txn``: the client transaction the event was sent in, recorded
    with it in the same database transaction (``roomstore.events.write.client_txns``
    says what happens when that transaction already names another event).
    """

    raw: bytes
    room_version: str | None = None
    outlier: bool = False
    rejected_reason: str | None = None
    backfilled: bool = False
    state_before: Mapping[StateKey, str] | StateDelta | None = None
    auth_checked: bool = False
    client_txn: ClientTxn | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(ClientTxn))
    )

    def __reduce__(self):
        # Pickled (to a validation worker) through its constructor, not
        # attrs' slotted __getstate__, which is Python.
        return EventToPersist, (
            self.raw,
            self.room_version,
            self.outlier,
            self.rejected_reason,
            self.backfilled,
            self.state_before,
            self.auth_checked,
            self.client_txn,
        )


@attrs.frozen
class PersistedEvent:
    """Where an event landed. ``already_persisted``: it was stored before."""

    event_id: str
    room_id: str
    stream_ordering: int
    topological_ordering: int
    state_group_before: int | None
    state_group: int | None
    already_persisted: bool = False
    #: The event's content hash did not match: it is stored in its redacted
    #: form (``pdu/content_hash.py``).
    content_hash_mismatch: bool = False
    #: Every signature the event needs was verified against the keys given
    #: (``persist_events(verify_keys=...)``); False when none were given.
    signatures_checked: bool = False
    #: Why the event is stored rejected (it broke the room's authorization
    #: rules, or the caller said so), or None: accepted. Of this write only
    #: (None where ``already_persisted``: ``get_event_flags`` tells).
    rejected_reason: str | None = None
    #: Accepted, but it failed the room's current state as it arrived: not
    #: served in timelines, no extremity (of this write, as ``rejected_reason``).
    soft_failed: bool = False
    #: The event was given with a ``client_txn`` already recorded for this
    #: other event: the event is stored, the record left as it was (a
    #: retried request; answer it with this ID). None otherwise.
    existing_txn_event_id: str | None = None

    def __reduce__(self):
        # Pickled (a writer process's replies) through its constructor, not
        # attrs' slotted __getstate__, which is Python.
        return PersistedEvent, (
            self.event_id,
            self.room_id,
            self.stream_ordering,
            self.topological_ordering,
            self.state_group_before,
            self.state_group,
            self.already_persisted,
            self.content_hash_mismatch,
            self.signatures_checked,
            self.rejected_reason,
            self.soft_failed,
            self.existing_txn_event_id,
        )

    @property
    def stream_token(self) -> str:
        return f"s{self.stream_ordering}"

    @property
    def topological_token(self) -> str:
        return f"t{self.topological_ordering}-{self.stream_ordering}"


@attrs.frozen
class PreparedEvent:
    """A validated event with its flags, ready for the transaction."""

    pdu: ParsedPdu
    outlier: bool
    rejected_reason: str | None
    backfilled: bool
    state_before: Mapping[StateKey, str] | StateDelta | None
    #: Its content hash failed: ``pdu`` is its redacted form (pdu/content_hash.py).
    content_hash_mismatch: bool = False
    #: Every signature it needs was verified (``pdu/signatures.py``).
    signatures_checked: bool = False
    #: Its source checked it against the auth rules (``EventToPersist.auth_checked``).
    auth_checked: bool = False
    #: It passed the auth rules against its auth events and the state before
    #: it, not against the room's current state (the write decides it:
    #: ``roomstore.events.write.auth_checks``).
    soft_failed: bool = False
    #: The client transaction it was sent in (``EventToPersist.client_txn``).
    client_txn: ClientTxn | None = None
    #: Validated by the version of its room's create event in an earlier call
    #: still in flight (``BatchRooms.needed_by``): the write refuses it if the
    #: room has no stored version by then, as validation would have.
    version_assumed: bool = False
    event_id: str = attrs.field(init=False, default=attrs.Factory(lambda self: self.pdu.event_id, takes_self=True))

    def with_version_assumed(self) -> PreparedEvent:
        """This event, ``version_assumed`` (by its constructor: ``attrs.evolve`` costs several times more)."""
        return PreparedEvent(*self._args_but_version_assumed(), version_assumed=True)

    def __reduce__(self):
        # Unpickled by its constructor: attrs' own __setstate__ for slotted
        # classes is Python, and was half of a validation reply's unpickling.
        return PreparedEvent, (*self._args_but_version_assumed(), self.version_assumed)

    def _args_but_version_assumed(
        self,
    ) -> tuple[
        ParsedPdu,
        bool,
        str | None,
        bool,
        Mapping[StateKey, str] | StateDelta | None,
        bool,
        bool,
        bool,
        bool,
        ClientTxn | None,
    ]:
        """The constructor's arguments, in order, up to ``version_assumed``."""
        return (
            self.pdu,
            self.outlier,
            self.rejected_reason,
            self.backfilled,
            self.state_before,
            self.content_hash_mismatch,
            self.signatures_checked,
            self.auth_checked,
            self.soft_failed,
            self.client_txn,
        )


def peek_room_version(raw: bytes) -> tuple[str | None, str | None, str | None]:
    """(room_id, type, content.room_version) from raw bytes, for version lookup."""
    if len(raw) > MAX_PDU_SIZE:  # parse_pdu says so too; not worth decoding here
        raise InvalidEventError(f"PDU is {len(raw)} bytes; the limit is {MAX_PDU_SIZE} bytes")
    obj = quick_json(raw)
    if obj is None:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidEventError(f"event is not valid UTF-8 JSON: {exc}") from None
        except RecursionError:
            raise InvalidEventError(f"PDU JSON is nested too deeply; the limit is {MAX_JSON_NESTING} levels") from None
    if not isinstance(obj, dict):
        raise InvalidEventError("event is not a JSON object")
    content = obj.get("content")
    version = content.get("room_version") if isinstance(content, dict) else None
    room_id = obj.get("room_id") if isinstance(obj.get("room_id"), str) else None
    event_type = obj.get("type") if isinstance(obj.get("type"), str) else None
    return room_id, event_type, version if isinstance(version, str) else None


def peek_event_id(raw: bytes) -> str | None:
    """The ``event_id`` a PDU names (v1/v2 carry theirs), or None."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    event_id = obj.get("event_id") if isinstance(obj, dict) else None
    return event_id if isinstance(event_id, str) else None


def prepare_events(
    events: Sequence[EventToPersist],
    known_versions: Mapping[str, str],
    refuse_hash_mismatch: bool = False,
    verify_keys: VerifyKeys | None = None,
    pause_every: int = 0,
) -> list[PreparedEvent]:
    """Validate a batch; resolve room versions from the batch's create events
    and ``known_versions`` (room_id -> version) where not given. With
    ``verify_keys``, signatures are checked where the keys allow
    (``InvalidSignature``). An event whose content hash fails is replaced by
    its redacted form, or with ``refuse_hash_mismatch`` refused
    (``ContentHashMismatch``).

    ``pause_every=N`` (off a reactor thread): the GIL is let go after every N
    events, so the reactor thread waiting for it runs within a few events'
    work, not up to the interpreter's switch interval (5 ms)."""
    versions = dict(known_versions)
    prepared = []
    for index, item in enumerate(events):
        if pause_every and index % pause_every == pause_every - 1:
            time.sleep(0)
        if not isinstance(item, EventToPersist):
            raise TypeError(f"event {index} is {type(item).__name__}, not EventToPersist")
        version_id = item.room_version
        if version_id is None:
            room_id, event_type, create_version = peek_room_version(item.raw)
            if event_type == "m.room.create":
                version_id = create_version or "1"
            elif room_id in versions:
                version_id = versions[room_id]
            else:
                raise InvalidEventError(
                    f"event {index}: no room_version given and the room {room_id!r} is unknown "
                    "(persist its create event first, or pass room_version)"
                )
        pdu = parse_pdu(item.raw, get_room_version(version_id))
        signed = verify_keys is not None and signatures_checked(pdu, verify_keys)
        pdu, mismatch = checked_pdu(pdu, refuse_hash_mismatch)
        if pdu.type == "m.room.create" and pdu.state_key == "":
            versions[pdu.room_id] = version_id
        prepared.append(
            PreparedEvent(
                pdu,
                item.outlier,
                item.rejected_reason,
                item.backfilled,
                item.state_before,
                mismatch,
                signed,
                item.auth_checked,
                client_txn=item.client_txn,
            )
        )
    return prepared


def is_orphan(ev: PreparedEvent) -> bool:
    """A live event with nothing to hang it on: not a create event, no prev
    events, no state given. It may only start a room it is the create of."""
    return (
        not ev.outlier
        and not ev.pdu.prev_event_ids
        and ev.state_before is None
        and not (ev.pdu.type == "m.room.create" and ev.pdu.state_key == "")
    )


def orphan_rooms(prepared: Sequence[PreparedEvent], known_versions: Mapping[str, str]) -> list[str]:
    """Rooms of the batch's orphans (``is_orphan``) whose create event is
    neither in the batch nor among ``known_versions``: to be looked up."""
    created = {ev.pdu.room_id for ev in prepared if ev.pdu.type == "m.room.create" and ev.pdu.state_key == ""}
    return sorted(
        {ev.pdu.room_id for ev in prepared if is_orphan(ev) and ev.pdu.room_id not in created} - set(known_versions)
    )


def first_copies(prepared: Sequence[PreparedEvent]) -> dict[str, int]:
    """event ID -> index of its first copy in ``prepared`` (an event given
    twice is stored once: later copies report it as already persisted)."""
    first_index: dict[str, int] = {}
    for index, ev in enumerate(prepared):
        first_index.setdefault(ev.event_id, index)
    return first_index


def results_in_order(
    prepared: Sequence[PreparedEvent], first_index: Mapping[str, int], results: Mapping[str, PersistedEvent]
) -> list[PersistedEvent]:
    """A result per event given, in order: later copies already persisted,
    with each copy's own validation flags."""
    out = []
    for index, ev in enumerate(prepared):
        result = results[ev.event_id]
        if first_index[ev.event_id] != index:
            result = attrs.evolve(result, already_persisted=True)
        if ev.content_hash_mismatch or ev.signatures_checked:
            result = attrs.evolve(
                result, content_hash_mismatch=ev.content_hash_mismatch, signatures_checked=ev.signatures_checked
            )
        out.append(result)
    return out


def _in_order(batch: Sequence[PreparedEvent], by_id: Mapping[str, PreparedEvent]) -> bool:
    """Whether each event of ``batch`` comes after its prev events in it."""
    seen: set[str] = set()
    for ev in batch:
        for prev_id in ev.pdu.prev_event_ids:
            if prev_id in by_id and prev_id not in seen:
                return False
        seen.add(ev.event_id)
    return True


class PrevEventsCycle(InvalidEventError):
    """Events of a batch whose ``prev_events`` cite each other round
    (``event_ids``, each citing the next and the last the first)."""

    def __init__(self, event_ids: Sequence[str]) -> None:
        super().__init__(
            f"events {', '.join(event_ids)} cite each other round in 'prev_events': no event can come first",
            "prev_events",
        )
        self.event_ids = tuple(event_ids)


class AssumedVersionWrong(InvalidEventError):
    """An event validated by the version of its room's create event in an
    earlier call (``version_assumed``) whose room is stored at another
    version: that create event was a second one, refused. The event is not
    refused for it: ``RoomStore.persist_events`` validates it again by the
    stored version."""

    def __init__(self, event_id: str, room_id: str, assumed: str, stored: str) -> None:
        super().__init__(
            f"event {event_id} was validated as room version {assumed} but room {room_id} is stored at {stored}",
            "room_id",
        )


def order_batch(batch: Sequence[PreparedEvent]) -> list[PreparedEvent]:
    """The batch with each event after its prev events that are in the batch
    (stable otherwise); duplicates dropped. ``InvalidEventError`` where the
    batch's prev events form a cycle (possible only in v1/v2, whose PDUs name
    their own IDs): no order can put each event after its prevs."""
    by_id: dict[str, PreparedEvent] = {}
    for ev in batch:
        by_id.setdefault(ev.event_id, ev)
    if len(by_id) == len(batch) and _in_order(batch, by_id):
        return list(batch)  # usually so: checked before sorting
    ordered: list[PreparedEvent] = []
    placed: set[str] = set()
    visiting: set[str] = set()

    def place(ev: PreparedEvent) -> None:
        stack = [(ev, iter(ev.pdu.prev_event_ids))]
        visiting.add(ev.event_id)
        while stack:
            node, prevs = stack[-1]
            advanced = False
            for prev_id in prevs:
                prev = by_id.get(prev_id)
                if prev is not None and prev_id in visiting:
                    cycle = [item.event_id for item, _ in stack]
                    raise PrevEventsCycle(cycle[cycle.index(prev_id) :])
                if prev is not None and prev_id not in placed:
                    visiting.add(prev_id)
                    stack.append((prev, iter(prev.pdu.prev_event_ids)))
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                visiting.discard(node.event_id)
                if node.event_id not in placed:
                    placed.add(node.event_id)
                    ordered.append(node)

    for ev in by_id.values():
        if ev.event_id not in placed:
            place(ev)
    return ordered
