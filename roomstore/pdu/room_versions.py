"""Room versions 1-12 and the per-version rules this package depends on.

A room version fixes, among other things, the event ID format and the
redaction algorithm.  Everything here is pure data: :class:`RoomVersion` is a
frozen value and :data:`KNOWN_ROOM_VERSIONS` maps the identifier carried in
``m.room.create`` (``content.room_version``) to it.

Sources: the Matrix spec's room version pages (``/rooms/v1`` ... ``/rooms/v12``).
Redaction changes by version, as the spec states them:

* v1-v5: the base algorithm (``m.room.aliases`` keeps ``aliases``).
* v6: "All significant meaning for ``m.room.aliases`` has been removed from
  the redaction algorithm" (MSC2432).
* v8: "``m.room.join_rules`` events now keep ``allow``" (MSC3083).
* v9: "``m.room.member`` events now keep ``join_authorised_via_users_server``"
  (MSC3375).
* v11: "The top-level ``origin``, ``membership``, and ``prev_state`` properties
  are no longer protected from redaction. The ``m.room.create`` event now keeps
  the entire ``content`` property. The ``m.room.redaction`` event keeps the
  ``redacts`` property under ``content``. The ``m.room.power_levels`` event
  keeps the ``invite`` property under ``content``." and "it allows the
  ``signed`` key of the ``third_party_invite`` key" (MSC2176, MSC2174,
  MSC3821, MSC3989).
* v12: no change to redaction, event IDs or canonical JSON ("Unchanged from
  v11"); ``m.room.create`` keeps its whole content, so ``additional_creators``
  survives as v11 already implies.  What changes (MSC4291, MSC4289, MSC4297):

  - the room ID is ``!`` + the create event's reference hash in unpadded
    URL-safe base64 (its event ID with ``!`` for ``$``); the create event
    carries no ``room_id``, every other event carries that ID, which has no
    server part;
  - the create event is never listed in ``auth_events``: it is implied in
    every auth chain;
  - the room's creators (the create event's ``sender`` and
    ``content.additional_creators``) have infinite power, and power levels
    may not list them in ``users``;
  - state resolution 2.1 (MSC4297), recorded here as data
    (:attr:`RoomVersion.state_res_version`) and implemented, with v1 and
    v2, by ``roomstore.resolution``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs

__all__ = [
    "EventIdFormat",
    "KNOWN_ROOM_VERSIONS",
    "RoomVersion",
    "RoomVersions",
    "UnknownRoomVersion",
    "get_room_version",
]


class EventIdFormat(enum.Enum):
    """How a room version identifies its events."""

    #: v1/v2: ``$opaque:server``, chosen by the sender and carried in the PDU
    #: as ``event_id``; ``prev_events``/``auth_events`` are lists of
    #: ``[event_id, {"sha256": ...}]`` pairs.
    V1_V2 = "v1_v2"
    #: v3: ``$`` + unpadded *standard* base64 of the reference hash; never
    #: sent over federation; ``prev_events``/``auth_events`` are plain ID lists.
    V3 = "v3"
    #: v4+: as v3 but unpadded *URL-safe* base64 (``-``/``_`` for ``+``/``/``).
    V4_PLUS = "v4_plus"


class UnknownRoomVersion(ValueError):
    """Raised when a room version identifier is not one of 1-12.

    ``identifier`` holds the offending value (which may not even be a string).
    """

    def __init__(self, identifier: object) -> None:
        self.identifier = identifier
        known = ", ".join(KNOWN_ROOM_VERSIONS)
        super().__init__(f"Unknown room version {identifier!r}; known room versions are: {known}")


# Keys kept at the top level of an event by the redaction algorithm.
_TOP_LEVEL_KEYS_V11 = frozenset(
    {
        "event_id",
        "type",
        "room_id",
        "sender",
        "state_key",
        "content",
        "hashes",
        "signatures",
        "depth",
        "prev_events",
        "auth_events",
        "origin_server_ts",
    }
)
# Before v11 three more keys were protected (spec v1 list; MSC2176 removed them).
_TOP_LEVEL_KEYS_V1 = _TOP_LEVEL_KEYS_V11 | {"prev_state", "origin", "membership"}


@attrs.frozen(order=True)  # as attr.s: ordered by its fields
class RoomVersion:
    """The attributes of one room version that storage code needs.

    Instances are immutable and hashable; compare them with ``==`` or by
    ``identifier``.  Redaction rules are data: :meth:`preserved_content_keys`
    answers "which ``content`` keys of this event type survive redaction",
    and the two boolean special cases cover what a key list cannot express.
    """

    #: The identifier clients and servers use, e.g. ``"10"``.
    identifier: str
    event_id_format: EventIdFormat
    #: 1 for the original state resolution algorithm (v1 only), else 2
    #: (v12's 2.1 is a revision of 2: see :attr:`state_res_version`).
    state_res: int
    #: v5+: signing keys must be valid at ``origin_server_ts``.
    enforce_key_validity: bool
    #: v1-v5: special auth and redaction rules for ``m.room.aliases``.
    special_case_aliases_auth: bool
    #: v6+: integers must be in [-(2**53)+1, 2**53-1]; floats are forbidden.
    strict_canonicaljson: bool
    #: v6+: ``notifications`` in power levels is checked by the auth rules.
    limit_notifications_power_levels: bool
    #: v7+: the ``knock`` join rule and membership.
    knock_join_rule: bool
    #: v8+: the ``restricted`` join rule.
    restricted_join_rule: bool
    #: v10+: the ``knock_restricted`` join rule.
    knock_restricted_join_rule: bool
    #: v10+: power level values must be integers (no strings).
    enforce_int_power_levels: bool
    #: v11+: ``creator`` is gone from ``m.room.create``; the sender is the creator.
    implicit_room_creator: bool
    #: v11+: ``m.room.redaction`` carries ``redacts`` under ``content``
    #: instead of at the top level (MSC2174).
    redacts_in_content: bool
    #: v12+ (MSC4291): the room ID is ``!`` + the create event's reference
    #: hash; the create event has no ``room_id`` and is never listed in
    #: ``auth_events`` (it is implied in every auth chain).
    room_id_is_create_hash: bool
    #: v12+ (MSC4289): the creators (create ``sender`` plus
    #: ``content.additional_creators``) have infinite power and may not be
    #: listed in the power levels' ``users``.
    creators_have_infinite_power: bool
    #: v12+ (MSC4297): state resolution 2.1 rather than 2.
    state_res_v2_1: bool

    #: Top-level keys kept by the redaction algorithm.
    redaction_top_level_keys: frozenset[str]
    #: ``(event_type, kept content keys)`` pairs; a tuple so the class stays
    #: hashable.  Event types not listed lose all of their content.
    redaction_content_keys: tuple[tuple[str, frozenset[str]], ...]
    #: v11+: ``m.room.create`` keeps its entire content (MSC2176).
    redaction_create_keeps_all_content: bool
    #: v11+: ``m.room.member`` keeps ``third_party_invite.signed`` (MSC3821).
    redaction_keeps_third_party_invite_signed: bool

    def preserved_content_keys(self, event_type: str) -> frozenset[str]:
        """Return the ``content`` keys of ``event_type`` kept on redaction.

        For ``m.room.create`` in v11+ every key is kept; check
        :attr:`redaction_create_keeps_all_content` first.  The nested
        ``third_party_invite.signed`` rule of v11 is not a top-level content
        key and is therefore not listed here.
        """
        for listed_type, keys in self.redaction_content_keys:
            if listed_type == event_type:
                return keys
        return frozenset()

    @property
    def state_res_version(self) -> str:
        """The state resolution algorithm by its spec name: "1", "2" or "2.1"."""
        if self.state_res_v2_1:
            return "2.1"
        return str(self.state_res)

    @property
    def event_id_in_pdu(self) -> bool:
        """True when the PDU itself carries ``event_id`` (v1 and v2)."""
        return self.event_id_format is EventIdFormat.V1_V2


def _content_rules(
    *,
    aliases: bool,
    join_rule_allow: bool,
    join_authorised: bool,
    v11: bool,
) -> tuple[tuple[str, frozenset[str]], ...]:
    """Build the per-type content key table for one version."""
    member = {"membership"}
    if join_authorised:
        member.add("join_authorised_via_users_server")
    join_rules = {"join_rule"}
    if join_rule_allow:
        join_rules.add("allow")
    power_levels = {
        "ban",
        "events",
        "events_default",
        "kick",
        "redact",
        "state_default",
        "users",
        "users_default",
    }
    if v11:
        power_levels.add("invite")
    rules: dict[str, set[str]] = {
        "m.room.member": member,
        # In v11 create keeps *all* content; "creator" is listed for v1-v10 only.
        "m.room.create": set() if v11 else {"creator"},
        "m.room.join_rules": join_rules,
        "m.room.power_levels": power_levels,
        "m.room.history_visibility": {"history_visibility"},
    }
    if aliases:
        rules["m.room.aliases"] = {"aliases"}
    if v11:
        rules["m.room.redaction"] = {"redacts"}
    return tuple(sorted((t, frozenset(k)) for t, k in rules.items()))


def _version(number: int) -> RoomVersion:
    """Derive room version ``number`` from the list of changes in the spec
    (v12's redaction rules are v11's: it changes none of them)."""
    v11 = number >= 11
    if number <= 2:
        event_id_format = EventIdFormat.V1_V2
    elif number == 3:
        event_id_format = EventIdFormat.V3
    else:
        event_id_format = EventIdFormat.V4_PLUS
    return RoomVersion(
        identifier=str(number),
        event_id_format=event_id_format,
        state_res=1 if number == 1 else 2,
        enforce_key_validity=number >= 5,
        special_case_aliases_auth=number <= 5,
        strict_canonicaljson=number >= 6,
        limit_notifications_power_levels=number >= 6,
        knock_join_rule=number >= 7,
        restricted_join_rule=number >= 8,
        knock_restricted_join_rule=number >= 10,
        enforce_int_power_levels=number >= 10,
        implicit_room_creator=v11,
        redacts_in_content=v11,
        room_id_is_create_hash=number >= 12,
        creators_have_infinite_power=number >= 12,
        state_res_v2_1=number >= 12,
        redaction_top_level_keys=_TOP_LEVEL_KEYS_V11 if v11 else _TOP_LEVEL_KEYS_V1,
        redaction_content_keys=_content_rules(
            aliases=number <= 5,
            join_rule_allow=number >= 8,
            join_authorised=number >= 9,
            v11=v11,
        ),
        redaction_create_keeps_all_content=v11,
        redaction_keeps_third_party_invite_signed=v11,
    )


class RoomVersions:
    """Namespace holding one :class:`RoomVersion` per stable version."""

    V1 = _version(1)
    V2 = _version(2)
    V3 = _version(3)
    V4 = _version(4)
    V5 = _version(5)
    V6 = _version(6)
    V7 = _version(7)
    V8 = _version(8)
    V9 = _version(9)
    V10 = _version(10)
    V11 = _version(11)
    V12 = _version(12)


def _index(versions: Iterable[RoomVersion]) -> Mapping[str, RoomVersion]:
    return {v.identifier: v for v in versions}


#: Identifier -> :class:`RoomVersion` for every supported version, in order.
KNOWN_ROOM_VERSIONS: Mapping[str, RoomVersion] = _index(
    (
        RoomVersions.V1,
        RoomVersions.V2,
        RoomVersions.V3,
        RoomVersions.V4,
        RoomVersions.V5,
        RoomVersions.V6,
        RoomVersions.V7,
        RoomVersions.V8,
        RoomVersions.V9,
        RoomVersions.V10,
        RoomVersions.V11,
        RoomVersions.V12,
    )
)


def get_room_version(identifier: object) -> RoomVersion:
    """Return the :class:`RoomVersion` for ``identifier``.

    Raises:
        UnknownRoomVersion: ``identifier`` is not a known version string.
            Non-strings (e.g. the integer ``1``) are unknown too: the spec
            makes room version identifiers strings.
    """
    if isinstance(identifier, str):
        version = KNOWN_ROOM_VERSIONS.get(identifier)
        if version is not None:
            return version
    raise UnknownRoomVersion(identifier)
