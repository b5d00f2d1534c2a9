"""The authorization checks every event gets as it is written: the spec's
"checks performed on receipt of a PDU" 4 and 5 (server-server API):

1. against its own ``auth_events`` (``check_auth_events_shape`` then
   ``check_event_auth``): the events it cites are the ones the rules select,
   known, in its room and not rejected, and they allow it;
2. against the state before it (for graph events; an outlier has no state):
   the state's events of the same keys allow it.

An event failing either is stored rejected with the rule it broke as its
``rejected_reason``: kept, never served, never a forward extremity, never
part of state (``roomstore.events.write.persist``). A live event passing both
that fails against the room's current state as it arrives (check 6, "soft
failure") is stored soft-failed: part of the state after it, but never
served in a timeline, never a forward extremity, no change of membership. An event an earlier event of
the batch depends on is checked first (the batch is in prev-event order, and
an auth event is a prev event's ancestor or stored before).

An outlier citing auth events the store does not hold is stored unchecked:
it is an out-of-band membership event (an invite or knock from a room this
server is not in), whose room's events are elsewhere, as Synapse stores
them; an outlier is never served in a timeline.

Events whose ``auth_checked`` flag says their source checked them, and
events the caller already marked rejected, are taken as given.

Most events cite exactly the state before them: then the second check
reads the same events as the first and its answer is the same, so it is
skipped (``_same_events``). The state's events are read only where they
differ (a fork, or an event citing stale auth events).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from roomstore.events.resolution_source import resolve_interned
from roomstore.events.write.batch import PreparedEvent
from roomstore.pdu.auth_common import AuthError
from roomstore.pdu.auth_rules import auth_types_for_event, check_auth_events_shape, check_event_auth
from roomstore.pdu.parsing import ParsedPdu

CREATE = ("m.room.create", "")


def prefetch_auth_events(w: Any, new_events: Sequence[PreparedEvent]) -> None:
    """Read every stored auth event the batch's events cite, in one go, so
    that the checks below find them in the write's event source."""
    source = w.event_source
    wanted = {a for ev in new_events if _to_check(ev) for a in ev.pdu.auth_chain_event_ids} - w.pending_events.keys()
    if source.cache is not None:  # what the cache holds is at hand already
        wanted = {event_id for event_id in wanted if event_id not in source.cache}
    if wanted:
        source.get_events(wanted)


def remember_after_commit(w: Any, new_events: Sequence[PreparedEvent]) -> None:
    """Once the batch commits, its state events join the parsed-events
    cache, rejected or not as the checks left them: auth events are state
    events, so the next batches' checks find theirs without a read."""
    w.txn.call_after(_remember_state_events, w.p.parsed_events, new_events)


def _remember_state_events(cache: Any, new_events: list[PreparedEvent]) -> None:
    for ev in new_events:
        if ev.pdu.state_key is not None:
            cache.set(ev.event_id, (ev.pdu, ev.rejected_reason is not None))


def checked_event(
    w: Any,
    index: int,
    ev: PreparedEvent,
    new_events: list[PreparedEvent],
    group_before: int | None,
    room_nid: int | None = None,
) -> PreparedEvent:
    """``ev`` (``new_events[index]``) after the checks: itself, or where they
    reject or soft-fail it a copy saying so, put in its place in
    ``new_events`` and the batch's events, which the write's later steps read."""
    key_nids = _auth_key_nids(w, ev.pdu) if _to_check(ev) and not ev.pdu.is_create else {}
    reason = rejection_of(w, ev, group_before, key_nids)
    soft_failed = reason is None and room_nid is not None and soft_fails(w, ev, room_nid, group_before, key_nids)
    if reason == ev.rejected_reason and not soft_failed:
        return ev
    ev = attrs.evolve(ev, rejected_reason=reason, soft_failed=soft_failed)
    new_events[index] = w.pending_events[ev.event_id] = ev
    return ev


def soft_fails(
    w: Any, ev: PreparedEvent, room_nid: int, group_before: int | None, key_nids: Mapping[int, tuple[str, str]]
) -> bool:
    """Whether a live graph event the rules allow fails them against the
    room's current state as it arrives: the state of the room's forward
    extremities (``w.ends``, kept up to date through the batch) and of
    the event's own state before, resolved, as Synapse computes it. Only
    where its prev events are not the room's ends: else the state before
    it is the current state, already checked; nor where every state holds
    the same events at the keys the rules read (``key_nids``): resolution
    keeps unconflicted entries, so the check's answer is the one it had."""
    if ev.outlier or ev.backfilled or not _to_check(ev) or group_before is None:
        return False
    ends = w.ends.of(room_nid)
    nids = w.event_nids
    if not ends or set(ends) == {nids[p] for p in ev.pdu.prev_event_ids}:
        return False
    groups = [g for g in dict.fromkeys([*ends.values(), group_before]) if g is not None]
    states = [w.state_view(g) for g in groups]
    if _agree_at(states, key_nids):
        return False
    current = resolve_interned(w, ev.pdu.room_version, states)
    entries = {key: current[nid] for nid, key in key_nids.items() if nid in current}
    try:
        check_event_auth(ev.pdu.room_version, ev.pdu, state_events(w, entries))
    except AuthError:
        return True
    return False


def rejection_of(
    w: Any, ev: PreparedEvent, group_before: int | None, key_nids: Mapping[int, tuple[str, str]]
) -> str | None:
    """Why ``ev`` is rejected (its ``rejected_reason``), or None when the
    rules allow it. ``w``: the batch writer (``roomstore.events.write.persist``);
    ``group_before``: the state group before a graph event (None for an
    outlier, or the room's first event); ``key_nids``: ``_auth_key_nids``."""
    if not _to_check(ev):
        return ev.rejected_reason
    pdu = ev.pdu
    version = pdu.room_version
    try:
        if pdu.is_create:
            check_event_auth(version, pdu, {})
            return None
        cited_ids = pdu.auth_chain_event_ids
        passed = w.p.passed_auth_checks
        decided_by = _decided_by(pdu)
        alike = (decided_by, group_before) if decided_by is not None and group_before is not None else None
        if alike is not None and not ev.outlier and alike in w.accepted_alike:
            # An event alike in what decides it, against the same state,
            # took the quick path below in this transaction: so does this one.
            return None
        state_auth = None if ev.outlier else _state_auth_entries(w, key_nids, group_before)
        if decided_by is not None and state_auth is not None and decided_by in passed:
            if _cites_exactly(w, cited_ids, state_auth):
                # Both checks read the same accepted events (state holds no
                # rejected one), and events alike in what decides them passed.
                if alike is not None:
                    w.accepted_alike.add(alike)
                return None
        source = w.event_source
        cited = source.get_events(cited_ids)
        if ev.outlier and len(cited) < len(set(cited_ids)):
            return None  # out-of-band: its room's events are elsewhere (see the module docstring)
        rejected = source.rejected(cited_ids)
        if decided_by is not None and decided_by in passed and len(cited) == len(cited_ids) and not rejected:
            auth_state = {(e.type, e.state_key): e for e in cited.values()}
        else:
            selection = {key for key in key_nids.values() if key != CREATE or not version.room_id_is_create_hash}
            auth_state = check_auth_events_shape(version, pdu, cited, rejected, selection)
            check_event_auth(version, pdu, auth_state)
            if decided_by is not None:
                passed.set(decided_by, True)
        if state_auth is None:  # an outlier: no state to check against
            return None
        if _same_events(w, auth_state, state_auth):
            return None
        check_event_auth(version, pdu, state_events(w, state_auth))
    except AuthError as exc:
        return f"auth: {exc}"
    return None


#: Types whose rules read the event's content or ID (or that a v1/v2
#: redaction's do). The rules read nothing else of any other event than its
#: room, type, sender, state key and auth events.
_CONTENT_RULED = frozenset(
    {
        "m.room.create",
        "m.room.member",
        "m.room.power_levels",
        "m.room.aliases",
        "m.room.redaction",
    }
)


def _decided_by(pdu: ParsedPdu) -> tuple | None:
    """What decides the checks against ``pdu``'s own auth events, where
    that is not its content: two events alike in it pass or fail alike, so
    one that passed lets the next skip them (a conversation's messages cite
    the same few events). The cited events' presence and rejection are
    checked each time all the same: they are what a purge or a rolled-back
    write could change. None for the types that read more."""
    if pdu.type in _CONTENT_RULED:
        return None
    return (pdu.room_version.identifier, pdu.room_id, pdu.type, pdu.sender, pdu.state_key, pdu.auth_chain_event_ids)


def _to_check(ev: PreparedEvent) -> bool:
    return ev.rejected_reason is None and not ev.auth_checked


def _auth_key_nids(w: Any, pdu: ParsedPdu) -> dict[int, tuple[str, str]]:
    """The state keys the rules read for ``pdu`` (the create event's always,
    as the rules need it), interned: key nid -> key. The same for every
    event of a sender but member events (and the create event), so those
    are looked up once a batch."""
    memo = (pdu.room_version.identifier, pdu.sender) if pdu.type != "m.room.member" else None
    found = w.auth_keys_of_sender.get(memo) if memo is not None else None
    if found is None:
        keys = auth_types_for_event(pdu.room_version, pdu) | {CREATE}
        w.intern_keys(keys)
        found = {w.key_nids[key]: key for key in keys}
        if memo is not None:
            w.auth_keys_of_sender[memo] = found
    return found


def _agree_at(states: list[Mapping[int, int]], key_nids: Mapping[int, Any]) -> bool:
    """Whether every state holds one same event at each of ``key_nids``.
    A key no state holds does not agree: v2 resolution may fill it from the
    auth difference."""
    first = states[0]
    for k in key_nids:
        event_nid = first.get(k)
        if event_nid is None or any(state.get(k) != event_nid for state in states[1:]):
            return False
    return True


def _state_auth_entries(
    w: Any, key_nids: Mapping[int, tuple[str, str]], group_before: int | None
) -> dict[tuple[str, str], int]:
    """The state before an event at the keys the rules read for it
    (``key_nids``): key -> event nid."""
    if group_before is None:
        return {}
    pending = w.pending.get(group_before)
    if pending is not None:  # a group of this batch: its state is at hand
        state = pending.state
        return {key: state[k] for k, key in key_nids.items() if k in state}
    found = w.p.state_groups.get_state_filtered(w.txn, group_before, key_nids)
    return {key_nids[k]: event_nid for k, event_nid in found.items()}


def _same_events(w: Any, auth_state: Mapping[tuple[str, str], ParsedPdu], state_auth: Mapping[tuple, int]) -> bool:
    """Whether the state's entries are exactly the cited auth events."""
    if len(auth_state) != len(state_auth):
        return False
    nids = w.event_nids
    for key, event_nid in state_auth.items():
        cited = auth_state.get(key)
        if cited is None or nids.get(cited.event_id) != event_nid:
            return False
    return True


def _cites_exactly(w: Any, cited_ids: tuple[str, ...], state_auth: Mapping[tuple, int]) -> bool:
    """Whether the cited auth events are exactly the state's entries."""
    if len(cited_ids) != len(state_auth):
        return False
    nids = w.event_nids
    return {nids.get(event_id) for event_id in cited_ids} == set(state_auth.values())


def state_events(w: Any, state_auth: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], ParsedPdu]:
    """State entries (key -> event nid) as parsed events: the batch's own, the
    parsed-events cache, then one read of the rest."""
    names = w.p.interners.events.resolve(w.txn, list(set(state_auth.values())))
    events = w.event_source.get_events(names.values())
    return {key: events[names[nid]] for key, nid in state_auth.items() if names.get(nid) in events}
