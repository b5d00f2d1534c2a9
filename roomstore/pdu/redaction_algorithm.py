"""The spec's redaction algorithm, for room versions 1-11.

Two entry points:

* :func:`prune_event_dict` is the algorithm exactly as specified: it is what
  the reference hash (event IDs in v3+) and event signatures are computed
  over, so it must match other servers byte for byte once canonically encoded.
  In particular it drops ``unsigned`` entirely, as the spec's key list says.
* :func:`redacted_copy` is what we store and serve for a redacted event: the
  pruned event plus a small, documented ``unsigned`` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roomstore.pdu.room_versions import RoomVersion

__all__ = [
    "KEPT_UNSIGNED_KEYS",
    "copy_json",
    "prune_event_dict",
    "redacted_copy",
    "redacts_of",
]

#: ``unsigned`` keys that survive in :func:`redacted_copy`.
#:
#: The spec's algorithm strips ``unsigned`` altogether (it is not in the key
#: list), and ``unsigned`` is never covered by hashes or signatures, so what
#: servers keep there is a local choice.  We keep what Synapse keeps:
#:
#: * ``age_ts``: when the event was received, needed to compute
#:   ``unsigned.age`` for clients; it is server metadata, not sender content.
#: * ``replaces_state``: the ID of the state event this one replaced; derived
#:   from room state by the server, so it reveals nothing the sender wrote.
#:
#: Everything else goes, notably ``prev_content`` (the previous state's
#: content, recomputed at serve time if wanted), ``transaction_id`` and any
#: stripped ``invite_room_state``/``knock_room_state``.
#: ``redacted_because`` is then added by :func:`redacted_copy` as the
#: client-server spec describes ("The event that redacted this event, if any").
KEPT_UNSIGNED_KEYS: frozenset[str] = frozenset({"age_ts", "replaces_state"})


def _share(value: Any) -> Any:
    return value


def copy_json(value: Any) -> Any:
    """Deep-copy a JSON value (objects, arrays, scalars) without recursion.

    Iterative so that deeply nested content the JSON parser accepted cannot
    overflow the Python stack (``copy.deepcopy`` recurses).  Mappings become
    dicts and tuples become lists; scalars are immutable and returned as is.
    """
    if not _is_container(value):
        return value  # the common case: a string or number
    root: Any = {} if _is_object(value) else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if _is_object(source) else enumerate(source)
        is_dict = type(target) is dict
        for key, child in items:
            if _is_container(child):
                new: Any = {} if _is_object(child) else []
                stack.append((child, new))
            else:
                new = child
            if is_dict:
                target[key] = new
            else:
                target.append(new)
    return root


_copy_json = copy_json


def _is_object(value: Any) -> bool:
    # Concrete types first: isinstance against typing.Mapping goes through
    # the ABC machinery and dominated the cost of hashing events.
    return type(value) is dict or (type(value) not in _SCALARS and isinstance(value, Mapping))


def _is_container(value: Any) -> bool:
    kind = type(value)
    if kind is dict or kind is list:
        return True
    if kind in _SCALARS:
        return False
    return isinstance(value, (Mapping, list, tuple))


_SCALARS = frozenset({str, int, float, bool, type(None)})


def prune_event_dict(
    room_version: RoomVersion, event_dict: Mapping[str, Any], *, deep_copy: bool = True
) -> dict[str, Any]:
    """Apply the redaction algorithm of ``room_version`` to ``event_dict``.

    Contract:
        * Returns a new dict that shares no mutable structure with the input
          (kept values are deep-copied); the input is never modified.
        * Top-level keys not protected by the version are removed, including
          ``unsigned``; ``content`` is always present in the result (an empty
          object if nothing survives, or if the input's content was missing or
          not an object).
        * The event's ``type`` selects which content keys survive; an event
          without a string ``type`` keeps no content.
        * ``deep_copy=False`` shares kept values with the input instead of
          copying them (only the two top-level dicts are new): for callers
          that only serialise the result, such as the reference hash.
    """
    copy_json = _copy_json if deep_copy else _share
    top_level_keys = room_version.redaction_top_level_keys
    if deep_copy:
        pruned: dict[str, Any] = {key: copy_json(value) for key, value in event_dict.items() if key in top_level_keys}
    else:  # the reference hash of every event stored: no call per key
        pruned = {key: value for key, value in event_dict.items() if key in top_level_keys}

    content = event_dict.get("content")
    if type(content) is not dict and not isinstance(content, Mapping):  # typing's isinstance is slow
        content = {}
    event_type = event_dict.get("type")

    new_content: dict[str, Any]
    if event_type == "m.room.create" and room_version.redaction_create_keeps_all_content:
        new_content = copy_json(content)
    else:
        kept = room_version.preserved_content_keys(event_type) if isinstance(event_type, str) else frozenset()
        if deep_copy:
            new_content = {k: copy_json(v) for k, v in content.items() if k in kept}
        else:
            new_content = {k: v for k, v in content.items() if k in kept}

    if event_type == "m.room.member" and room_version.redaction_keeps_third_party_invite_signed:
        # v11: "it allows the `signed` key of the `third_party_invite` key"; and
        # "The third_party_invite key ... will only contain the signed key after
        # redaction".  Like Synapse, an object `third_party_invite` without
        # `signed` survives as `{}`; a non-object one is dropped.
        third_party_invite = content.get("third_party_invite")
        if isinstance(third_party_invite, Mapping):
            kept_invite: dict[str, Any] = {}
            if "signed" in third_party_invite:
                kept_invite["signed"] = copy_json(third_party_invite["signed"])
            new_content["third_party_invite"] = kept_invite

    pruned["content"] = new_content
    return pruned


def redacts_of(room_version: RoomVersion, event_dict: Mapping[str, Any]) -> str | None:
    """Return the event ID an ``m.room.redaction`` event redacts, or None.

    Before v11 ``redacts`` is a top-level key; from v11 it lives in
    ``content`` (MSC2174).  Returns None for other event types, when the key
    is absent, or when it is not a string.
    """
    if event_dict.get("type") != "m.room.redaction":
        return None
    if room_version.redacts_in_content:
        content = event_dict.get("content")
        value = content.get("redacts") if isinstance(content, Mapping) else None
    else:
        value = event_dict.get("redacts")
    return value if isinstance(value, str) else None


def redacted_copy(
    event_dict: Mapping[str, Any],
    room_version: RoomVersion,
    redaction_event_dict: Mapping[str, Any],
) -> dict[str, Any]:
    """Return the redacted form of ``event_dict`` to store and serve.

    The result is :func:`prune_event_dict` plus an ``unsigned`` object with
    the keys of :data:`KEPT_UNSIGNED_KEYS` that the original had, and
    ``redacted_because`` set to a deep copy of ``redaction_event_dict``.
    Neither input is modified.

    Raises:
        ValueError: ``redaction_event_dict`` is not an ``m.room.redaction``
            event; or the two events name different rooms; or both event IDs
            are known (``event_dict["event_id"]`` and the redaction's
            ``redacts``) and they differ.  Checks needing a value that is
            absent are skipped: v3+ PDUs carry no ``event_id``.
    """
    if redaction_event_dict.get("type") != "m.room.redaction":
        raise ValueError(
            f"redaction_event_dict must be an m.room.redaction event, got type {redaction_event_dict.get('type')!r}"
        )
    room_id = event_dict.get("room_id")
    redaction_room_id = redaction_event_dict.get("room_id")
    if room_id is not None and redaction_room_id is not None and room_id != redaction_room_id:
        raise ValueError(f"redaction is in room {redaction_room_id!r} but the event is in {room_id!r}")
    target = redacts_of(room_version, redaction_event_dict)
    event_id = event_dict.get("event_id")
    if target is not None and event_id is not None and target != event_id:
        raise ValueError(f"redaction targets {target!r}, not {event_id!r}")

    redacted = prune_event_dict(room_version, event_dict)
    old_unsigned = event_dict.get("unsigned")
    unsigned: dict[str, Any] = {}
    if isinstance(old_unsigned, Mapping):
        unsigned = {k: copy_json(v) for k, v in old_unsigned.items() if k in KEPT_UNSIGNED_KEYS}
    unsigned["redacted_because"] = copy_json(redaction_event_dict)
    redacted["unsigned"] = unsigned
    return redacted
