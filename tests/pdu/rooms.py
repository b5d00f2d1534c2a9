"""A room built event by event for the auth rule and state resolution tests,
and Synapse 1.163.2 as the oracle on the same events.

:class:`Room` keeps a current state and builds real PDUs (hashed, with
event IDs in the room version's format, parsed by ``parse_pdu``) whose
``auth_events`` are chosen by the auth events selection from a state
(the current one unless told otherwise).  :class:`Oracle` runs Synapse's
``synapse.event_auth`` and ``synapse.state`` on the same events.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from canonicaljson import encode_canonical_json

from roomstore.pdu.auth_rules import auth_types_for_event
from roomstore.pdu.hashing import compute_content_hash
from roomstore.pdu.parsing import ParsedPdu, parse_pdu
from roomstore.pdu.room_versions import get_room_version
from tests.synapse_oracle import prepare_synapse

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
CAROL = "@carol:example.org"
DAVE = "@dave:other.example"
EVE = "@eve:example.org"
ZARA = "@zara:example.org"

StateMap = dict[tuple[str, str], ParsedPdu]


#: Shared by every room: event IDs (v1/v2) and timestamps never repeat across rooms,
#: so no two rooms make the same event (a v12 room's ID is its create event's hash).
_COUNTER = itertools.count(1)
_CLOCK = itertools.count(1_700_000_000_000, 1000)


class Room:
    """One room's events.  ``state`` is the state after the last applied event."""

    def __init__(
        self,
        version: str,
        creator: str = ALICE,
        additional_creators: Sequence[str] = (),
        room_id: str = "!room:example.org",
    ) -> None:
        self.version = version
        self.room_version = get_room_version(version)
        self.creator = creator
        self.additional_creators = list(additional_creators)
        self.room_id = "" if self.room_version.room_id_is_create_hash else room_id
        self.state: StateMap = {}
        self.events: dict[str, ParsedPdu] = {}
        self.leaves: list[str] = []
        self.ts = 1_700_000_000_000
        self.counter = 0

    # ------------------------------------------------------------ building

    def build(
        self,
        event_type: str,
        sender: str,
        content: dict,
        state_key: str | None = None,
        *,
        prev: Sequence[str] | None = None,
        auth: Sequence[str] | None = None,
        state: Mapping | None = None,
        apply: bool = True,
        extra: dict | None = None,
        ts: int | None = None,
        signers: Iterable[str] = (),
    ) -> ParsedPdu:
        """Build an event; its auth events are ``auth`` or those the selection
        picks from ``state`` (default: the current state).  ``apply``: make it
        the new leaf, and, for a state event, part of the current state."""
        self.counter = next(_COUNTER)
        self.ts = ts if ts is not None else next(_CLOCK)
        prev_ids = list(self.leaves if prev is None else prev)
        event: dict[str, Any] = {
            "content": content,
            "origin_server_ts": self.ts,
            "sender": sender,
            "type": event_type,
            "depth": max([self.events[p].depth for p in prev_ids if p in self.events] or [0]) + 1,
            "room_id": self.room_id,
            "hashes": {},
            "auth_events": [],
            "prev_events": [],
        }
        if state_key is not None:
            event["state_key"] = state_key
        is_create = event_type == "m.room.create" and state_key == ""
        if is_create and self.room_version.room_id_is_create_hash:
            del event["room_id"]
        if self.room_version.event_id_in_pdu:
            event["event_id"] = f"${self.counter}x:{sender.partition(':')[2]}"
        event.update(extra or {})
        servers = {sender.partition(":")[2], *signers}
        event["signatures"] = {server: {"ed25519:a": "c2lnbmF0dXJl"} for server in sorted(servers)}
        if auth is None:
            provisional = self._parse(event)
            chosen = state if state is not None else self.state
            auth = [
                chosen[key].event_id
                for key in sorted(auth_types_for_event(self.room_version, provisional))
                if key in chosen
            ]
        event["prev_events"] = self._references(prev_ids)
        event["auth_events"] = self._references(auth)
        pdu = self._parse(event)
        if is_create and self.room_version.room_id_is_create_hash:
            self.room_id = pdu.room_id
        self.events[pdu.event_id] = pdu
        if apply:
            self.leaves = [pdu.event_id]
            if pdu.state_key is not None:
                self.state[(pdu.type, pdu.state_key)] = pdu
        return pdu

    def _references(self, ids: Sequence[str]) -> list:
        if self.room_version.event_id_in_pdu:
            return [[event_id, {"sha256": "aGFzaA"}] for event_id in ids]
        return list(ids)

    def _parse(self, event: dict) -> ParsedPdu:
        event = copy.deepcopy(event)
        event["hashes"] = {"sha256": compute_content_hash(event)}
        return parse_pdu(encode_canonical_json(event), self.room_version)

    # ------------------------------------------------------------ shorthands

    def create(self, **content: Any) -> ParsedPdu:
        body: dict[str, Any] = {"room_version": self.version}
        if not self.room_version.implicit_room_creator:
            body["creator"] = self.creator
        if self.additional_creators:
            body["additional_creators"] = list(self.additional_creators)
        body.update(content)
        return self.build("m.room.create", self.creator, body, "")

    def member(self, target: str, membership: str, sender: str | None = None, **kw: Any) -> ParsedPdu:
        content = {"membership": membership, **kw.pop("content", {})}
        return self.build("m.room.member", sender or target, content, target, **kw)

    def power_levels(
        self,
        users: Mapping[str, Any],
        sender: str | None = None,
        *,
        apply: bool = True,
        prev: Sequence[str] | None = None,
        state: Mapping | None = None,
        ts: int | None = None,
        **content: Any,
    ) -> ParsedPdu:
        return self.build(
            "m.room.power_levels",
            sender or self.creator,
            {"users": dict(users), **content},
            "",
            apply=apply,
            prev=prev,
            state=state,
            ts=ts,
        )

    def join_rules(
        self,
        rule: str,
        sender: str | None = None,
        *,
        apply: bool = True,
        prev: Sequence[str] | None = None,
        state: Mapping | None = None,
        ts: int | None = None,
        **content: Any,
    ) -> ParsedPdu:
        return self.build(
            "m.room.join_rules",
            sender or self.creator,
            {"join_rule": rule, **content},
            "",
            apply=apply,
            prev=prev,
            state=state,
            ts=ts,
        )

    def standard(
        self, join_rule: str = "invite", users: Mapping[str, int] | None = None, members: Sequence[str] = ()
    ) -> Room:
        """create, the creator's join, power levels (creator 100 unless v12), join rules, then
        ``members`` joined (invited by the creator first unless the room is public)."""
        self.create()
        self.member(self.creator, "join")
        levels = {} if self.room_version.creators_have_infinite_power else {self.creator: 100}
        levels.update(users or {})
        self.power_levels(levels)
        self.join_rules(join_rule)
        for user in members:
            if join_rule != "public":
                self.member(user, "invite", self.creator)
            self.member(user, "join")
        return self


def _run(coroutine: Any) -> Any:
    """Run a coroutine that never waits (Synapse's auth code on an in-memory store)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the coroutine waited on something")


class _Store:
    """Synapse's event source protocol over a dict of its events."""

    def __init__(self, events: Mapping[str, Any]) -> None:
        self.events = events

    async def get_events(self, event_ids, redact_behaviour=None, get_prev_content=False, allow_rejected=False):
        return {event_id: self.events[event_id] for event_id in event_ids if event_id in self.events}


class Oracle:
    """Synapse 1.163.2, in this process, on the same events."""

    def __init__(self) -> None:
        if not prepare_synapse():
            raise AssertionError("matrix-synapse (the test extra) is not installed: it is these tests' oracle")
        from synapse import event_auth
        from synapse.api.errors import SynapseError
        from synapse.api.room_versions import KNOWN_ROOM_VERSIONS
        from synapse.events import make_event_from_dict

        self.errors = SynapseError
        self.versions = KNOWN_ROOM_VERSIONS
        self.event_auth = event_auth
        self.make_event = make_event_from_dict
        self._cache: dict[tuple[bytes, bool], Any] = {}

    def event(self, pdu: ParsedPdu, rejected: bool = False) -> Any:
        key = (pdu.raw, rejected)
        if key not in self._cache:
            theirs = self.make_event(
                copy.deepcopy(dict(pdu.event_dict)),
                self.versions[pdu.room_version.identifier],
                rejected_reason="auth_error" if rejected else None,
            )
            assert theirs.event_id == pdu.event_id, (theirs.event_id, pdu.event_id)
            self._cache[key] = theirs
        return self._cache[key]

    def allows(self, pdu: ParsedPdu, state: Mapping[tuple[str, str], ParsedPdu]) -> bool:
        """Synapse's state-dependent rules on ``pdu`` against ``state``."""
        try:
            self.event_auth.check_state_dependent_auth_rules(self.event(pdu), [self.event(e) for e in state.values()])
        except self.errors:
            return False
        return True

    def resolve(
        self,
        room_version: str,
        state_sets: Sequence[Mapping],
        events: Mapping[str, ParsedPdu],
        rejected: Iterable[str] = (),
    ) -> dict:
        """Synapse's state resolution (``synapse.state.v1``/``v2``) of ``state_sets``."""
        return _oracle_resolve(self, room_version, state_sets, events, rejected)

    def allows_auth_events(self, pdu: ParsedPdu, events: Mapping[str, ParsedPdu]) -> bool:
        """Synapse's state-independent rules (the auth events' shape) on ``pdu``."""
        store = _Store({event_id: self.event(event) for event_id, event in events.items()})
        try:
            _run(self.event_auth.check_state_independent_auth_rules(store, self.event(pdu)))
        except self.errors:
            return False
        return True


class _NoClock:
    async def sleep(self, duration: Any) -> None:
        return None


class _ResolutionStore:
    """Synapse's ``StateResolutionStore`` protocol over a dict of its events,
    with its own walks of the auth graph (none of roomstore's code)."""

    def __init__(self, events: Mapping[str, Any]) -> None:
        self.events = events

    async def get_events(self, event_ids, allow_rejected=False):
        found = {e: self.events[e] for e in event_ids if e in self.events}
        return found if allow_rejected else {e: ev for e, ev in found.items() if not ev.rejected_reason}

    def _chain(self, event_ids) -> set[str]:
        seen, stack = set(), list(event_ids)
        while stack:
            event_id = stack.pop()
            if event_id not in seen:
                seen.add(event_id)
                event = self.events.get(event_id)
                stack.extend(event.auth_event_ids() if event is not None else ())
        return seen

    async def get_auth_chain_difference(
        self, room_id, state_sets, conflicted_state=None, additional_backwards_reachable_conflicted_events=None
    ):
        from synapse.storage.databases.main.event_federation import StateDifference

        chains = [self._chain(s) for s in state_sets]
        difference = set.union(*chains) - set.intersection(*chains)
        subgraph = None
        if conflicted_state is not None:
            below = self._chain(conflicted_state)
            subgraph = {e for e in below if self._chain([e]) & set(conflicted_state)}
        return StateDifference(auth_difference=difference, conflicted_subgraph=subgraph)


def _oracle_resolve(
    oracle: Oracle,
    room_version: str,
    state_sets: Sequence[Mapping],
    events: Mapping[str, ParsedPdu],
    rejected: Iterable[str] = (),
) -> dict:
    from synapse.state import v1, v2

    rejected = set(rejected)
    theirs = {event_id: oracle.event(event, rejected=event_id in rejected) for event_id, event in events.items()}
    room_id = next(iter(events.values())).room_id
    version = oracle.versions[room_version]
    sets = [dict(s) for s in state_sets]
    if version.state_res == 1:

        async def factory(ids):
            return {i: theirs[i] for i in ids if i in theirs}

        result = _run(v1.resolve_events_with_store(room_id, version, sets, None, factory))
    else:
        result = _run(v2.resolve_events_with_store(_NoClock(), room_id, version, sets, None, _ResolutionStore(theirs)))
    return dict(result)
