"""History visibility as the spec states it: an independent test oracle.

The store computes visibility eagerly at persist time into tables; tests
check those tables against :func:`is_event_visible`, which is a direct,
deliberately naive transcription of the client-server spec, section "Room
History Visibility", over *full* room state.  It shares no code with the
eager implementation and should stay that way.

The spec text this follows (quoted verbatim):

    By default if no ``history_visibility`` is set, or if the value is not
    understood, the visibility is assumed to be ``shared``. The rules
    governing whether a user is allowed to see an event depend on the state
    of the room *at that event*.

    1. If the ``history_visibility`` was set to ``world_readable``, allow.
    2. If the user's ``membership`` was ``join``, allow.
    3. If ``history_visibility`` was set to ``shared``, and the user joined
       the room at any point after the event was sent, allow.
    4. If the user's ``membership`` was ``invite``, and the
       ``history_visibility`` was set to ``invited``, allow.
    5. Otherwise, deny.

    For ``m.room.history_visibility`` events themselves, the user should be
    allowed to see the event if the ``history_visibility`` before *or* after
    the event would allow them to see it. [...]

    Likewise, for the user's own ``m.room.member`` events, the user should be
    allowed to see the event if their ``membership`` before *or* after the
    event would allow them to see it. [...]

Where Synapse (``synapse/visibility.py``) gives different answers:

* **Own leave events.** Synapse always shows users their own ``leave`` when
  the previous membership was ``join`` or ``invite`` ("otherwise they won't
  see the room disappear if they reject the invite").  By the spec an
  invite -> leave (rejected or retracted invite) is visible only under
  ``invited`` visibility, or ``shared`` with a later join; the oracle denies
  it otherwise.  (join -> leave agrees: "before" is ``join``.)
* **"Joined after" vs "not peeking".** Synapse has no notion of "joined at
  any point after the event": it allows ``shared`` history whenever the
  requester is not peeking (is or was a member), and bounds what a departed
  user can page through by their leave position elsewhere.  The oracle takes
  rule 3 literally via the ``user_joined_after`` argument.
* **History visibility events.** Synapse replaces the before/after pair by
  the single "most permissive" value on the fixed ranking world_readable >
  shared > invited > joined.  ``shared`` and ``invited`` are not nested
  (``shared`` needs a later join, ``invited`` needs an invite at the event),
  so for an invited user who never joins, a change between ``invited`` and
  ``shared`` is visible by the spec (rule 4 holds on the ``invited`` side)
  but, when that user is peeking, not in Synapse.
* **Own membership events.** Synapse uses the "most joined" of the old and
  new membership (join > invite > knock > leave > ban).  The rules are
  monotone along that order, so this matches "before or after".
* **Everything else** Synapse filters for other reasons (outliers and
  out-of-band invites, erased senders, ignored users, ``m.room.aliases``,
  dummy events, retention) is outside history visibility and not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "StateMap",
    "allowed_by_rules",
    "history_visibility_in",
    "is_event_visible",
    "membership_in",
]

#: Room state: ``(event type, state_key)`` -> event dict.
StateMap = Mapping[tuple[str, str], Mapping[str, Any]]

# The spec's values, written here again: the oracle imports nothing of the
# store's visibility code (``codes``), which it checks.
_WORLD_READABLE, _SHARED, _INVITED, _JOINED = "world_readable", "shared", "invited", "joined"
_UNDERSTOOD = frozenset({_WORLD_READABLE, _SHARED, _INVITED, _JOINED})
_JOIN, _INVITE = "join", "invite"
_HISTORY_VISIBILITY_KEY = ("m.room.history_visibility", "")


def history_visibility_in(state: StateMap) -> str:
    """The effective history visibility in ``state``.

    "By default if no ``history_visibility`` is set, or if the value is not
    understood, the visibility is assumed to be ``shared``."  A missing
    event, a non-object content, a missing key and an unknown string all
    give ``shared``.
    """
    event = state.get(_HISTORY_VISIBILITY_KEY)
    content = event.get("content") if event is not None else None
    value = content.get("history_visibility") if isinstance(content, Mapping) else None
    return value if isinstance(value, str) and value in _UNDERSTOOD else _SHARED


def membership_in(state: StateMap, user_id: str) -> str | None:
    """``user_id``'s membership in ``state``, or None if there is none.

    A membership event whose ``content.membership`` is not a string counts as
    no membership.  Unknown strings are returned as they are; the rules only
    ever test for ``join`` and ``invite``.
    """
    event = state.get(("m.room.member", user_id))
    content = event.get("content") if event is not None else None
    value = content.get("membership") if isinstance(content, Mapping) else None
    return value if isinstance(value, str) else None


def allowed_by_rules(visibility: str, membership: str | None, user_joined_after: bool) -> bool:
    """Rules 1-5 of the spec for one (visibility, membership) pair."""
    if visibility == _WORLD_READABLE:  # rule 1
        return True
    if membership == _JOIN:  # rule 2
        return True
    if visibility == _SHARED and user_joined_after:  # rule 3
        return True
    if membership == _INVITE and visibility == _INVITED:  # rule 4
        return True
    return False  # rule 5


def is_event_visible(
    user_id: str,
    event: Mapping[str, Any],
    state_before: StateMap,
    state_after: StateMap,
    user_joined_after: bool,
) -> bool:
    """May ``user_id`` see ``event``, by the spec's history visibility rules?

    Args:
        user_id: the user asking.
        event: the event (a dict with ``type``, optional ``state_key``, ``content``).
        state_before: full room state before the event (excluding it).
        state_after: full room state after the event; for a state event this
            includes the event itself.  For a non-state event it equals
            ``state_before``.
        user_joined_after: whether the user's membership became ``join`` at
            some event after this one (rule 3's "joined the room at any point
            after the event was sent").

    "The state of the room *at that event*" is read from ``state_before``
    for ordinary events.  Only two entries matter, the history visibility
    and the user's own membership, and a state event changes only its own
    ``(type, state_key)``; so before and after differ on those entries only
    for the two kinds of event the spec singles out, and for those both
    sides are evaluated and either one allowing suffices.
    """
    event_type = event.get("type")
    state_key = event.get("state_key")
    visibility = history_visibility_in(state_before)
    membership = membership_in(state_before, user_id)

    if event_type == "m.room.history_visibility" and state_key == "":
        # "...if the history_visibility before *or* after the event would allow"
        return allowed_by_rules(visibility, membership, user_joined_after) or allowed_by_rules(
            history_visibility_in(state_after), membership, user_joined_after
        )

    if event_type == "m.room.member" and state_key == user_id:
        # "...if their membership before *or* after the event would allow"
        return allowed_by_rules(visibility, membership, user_joined_after) or allowed_by_rules(
            visibility, membership_in(state_after, user_id), user_joined_after
        )

    return allowed_by_rules(visibility, membership, user_joined_after)
