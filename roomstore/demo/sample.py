"""Generated room histories: the bundled demo sample, tests and benchmarks.

``RoomGraphBuilder`` appends well-formed events of one room (real content
hashes and reference-hash event IDs, so v3+ IDs are what a homeserver would
compute; signatures are placeholders) and tracks the room's leaves and depths.
Each event cites as ``auth_events`` what the auth events selection picks
from the state before it, so the store's authorization checks see what a
homeserver would send; whether the rules allow the event is the caller's
business (tests build forbidden events on purpose).
``generate_sample`` writes a deterministic multi-room history with membership
churn, redactions and history visibility changes, in rooms of versions 12,
11, 10, 9 and 6 (the first room is a version 12 room), as JSON lines in the import
format: ``{"room_version": "...", "event": {...}}`` or a bare PDU.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from roomstore.pdu.auth_rules import auth_types_for
from roomstore.pdu.hashing import compute_content_hash, compute_event_id, compute_reference_hash, unpadded_base64
from roomstore.pdu.power_levels import room_creators
from roomstore.pdu.room_versions import get_room_version


@attrs.frozen(eq=False)
class BuiltEvent:
    """An event built by ``RoomGraphBuilder``: its ID, bytes and dict.

    Compared by identity (``eq=False``): ``event`` is a dict, so value
    equality would make it unhashable.
    """

    event_id: str
    raw: bytes
    event: dict


class RoomGraphBuilder:
    """Builds one room's events; each new event's prev events default to the
    room's current leaves.

    Room version 12: the room ID is the create event's hash, so ``room_id``
    is ignored and :meth:`create` sets it (the create event carries none);
    ``additional_creators`` go into the create event's content."""

    def __init__(
        self,
        room_id: str = "!room:example.org",
        version: str = "10",
        creator: str = "@alice:example.org",
        start_ts: int = 1_700_000_000_000,
        additional_creators: Sequence[str] = (),
    ):
        self.room_version = get_room_version(version)
        self.hashed_room_id = self.room_version.room_id_is_create_hash
        #: v1/v2: the PDU carries its event ID and cites others as [ID, hashes] pairs.
        self.ids_in_pdu = self.room_version.event_id_in_pdu
        self.reference_hashes: dict[str, str] = {}
        # A v12 room has no ID before its create event.
        self.room_id = "" if self.hashed_room_id else room_id
        self.origin = creator.split(":", 1)[-1] if self.hashed_room_id else room_id.split(":", 1)[-1]
        self.version = version
        self.creator = creator
        self.additional_creators = list(additional_creators)
        self.leaves: list[str] = []
        self.depth_of: dict[str, int] = {}
        self.clock = start_ts
        self.events: list[BuiltEvent] = []
        #: event ID -> its prev events and its state key (None: not state),
        #: for the state before an event off the line (``state_at``).
        self._prevs: dict[str, list[str]] = {}
        self._state_key_of: dict[str, tuple[str, str] | None] = {}
        #: The last event built and the state after it, kept up to date in
        #: place: most events follow the last one, and copying a big room's
        #: state for each would cost quadratic time.
        self._line_head: str | None = None
        self._line_state: dict[tuple[str, str], str] = {}

    def resume(self, leaf: str, depth: int, state: dict[tuple[str, str], str]) -> None:
        """Go on building a room stored elsewhere: the next event follows
        ``leaf`` (at ``depth``), whose state after is ``state``."""
        self.leaves, self.depth_of[leaf] = [leaf], depth
        self._line_head, self._line_state = leaf, dict(state)

    def state_at(self, prev_ids: Sequence[str]) -> dict[tuple[str, str], str]:
        """The state after ``prev_ids`` (those this builder built): the
        state events among their ancestors, a later-built one winning a key
        (where branches conflict this is not state resolution, only a state
        an event may cite). The line's own dict where ``prev_ids`` is the
        last event: do not change it."""
        if list(prev_ids) == ([self._line_head] if self._line_head is not None else []):
            return self._line_state
        ancestors: set[str] = set()
        stack = [p for p in prev_ids if p in self._prevs]
        while stack:
            event_id = stack.pop()
            if event_id not in ancestors:
                ancestors.add(event_id)
                stack.extend(p for p in self._prevs[event_id] if p in self._prevs)
        state: dict[tuple[str, str], str] = {}
        for built in self.events:
            key = self._state_key_of[built.event_id]
            if key is not None and built.event_id in ancestors:
                state[key] = built.event_id
        return state

    def build(
        self,
        event_type: str,
        sender: str,
        content: dict,
        state_key: str | None = None,
        prev: Sequence[str] | None = None,
        extra: dict | None = None,
        set_leaves: bool = True,
    ) -> BuiltEvent:
        prev_ids = list(self.leaves if prev is None else prev)
        depth = max([self.depth_of[p] for p in prev_ids if p in self.depth_of] or [0]) + 1
        self.clock += 1000
        state = self.state_at(prev_ids)
        event: dict[str, Any] = {
            "auth_events": self._auth_events(state, event_type, sender, state_key, content),
            "content": content,
            "depth": depth,
            "origin": self.origin,
            "origin_server_ts": self.clock,
            "prev_events": [self._reference(p) for p in prev_ids] if self.ids_in_pdu else prev_ids,
            "room_id": self.room_id,
            "sender": sender,
            "type": event_type,
        }
        is_create = event_type == "m.room.create" and state_key == ""
        if self.hashed_room_id and is_create:
            del event["room_id"]  # v12: the room ID is this event's hash
        elif self.hashed_room_id and not self.room_id:
            raise ValueError("a room version 12 room has no ID before its create event: build that first")
        if state_key is not None:
            event["state_key"] = state_key
        if extra:
            event.update(extra)
        event["hashes"] = {"sha256": compute_content_hash(event)}
        event["signatures"] = {event["origin"]: {"ed25519:a": "c2lnbmF0dXJl"}}
        if self.ids_in_pdu:
            # v1/v2: the sender names the event; the ID is covered by the hashes.
            local = self.room_id[1:].partition(":")[0]
            event_id = event.setdefault("event_id", f"${local}-e{len(self.events)}:{self.origin}")
            event["hashes"] = {"sha256": compute_content_hash(event)}
        else:
            event_id = compute_event_id(self.room_version, event)
        if self.hashed_room_id and is_create:
            self.room_id = "!" + event_id[1:]
        if self.ids_in_pdu:
            digest = compute_reference_hash(self.room_version, event)
            self.reference_hashes[event_id] = unpadded_base64(digest, urlsafe=False)
        return self.add_built(BuiltEvent(event_id, json.dumps(event).encode("utf-8"), event), set_leaves)

    def add_built(self, built: BuiltEvent, set_leaves: bool = True) -> BuiltEvent:
        """Take ``built`` (from :meth:`build`, or an event built by hand on
        this room's leaves) as the room's next event: its depth, its place
        in the graph and the state after it."""
        event, event_id = built.event, built.event_id
        prev_ids = [p[0] if isinstance(p, list) else p for p in event.get("prev_events", [])]
        state_key = event.get("state_key")
        state = self.state_at(prev_ids)
        self.depth_of[event_id] = event["depth"]
        self._prevs[event_id] = prev_ids
        key = (event["type"], state_key) if state_key is not None else None
        self._state_key_of[event_id] = key
        if state is not self._line_state:
            self._line_state = dict(state)
        if key is not None:
            self._line_state[key] = event_id
        self._line_head = event_id
        if set_leaves:
            self.leaves = [leaf for leaf in self.leaves if leaf not in prev_ids] + [event_id]
        self.events.append(built)
        return built

    def auth_events_for(
        self,
        event_type: str,
        sender: str,
        state_key: str | None = None,
        content: dict | None = None,
        prev: Sequence[str] | None = None,
    ) -> list:
        """The ``auth_events`` :meth:`build` would cite for an event with
        these fields (for an event built by hand)."""
        state = self.state_at(list(self.leaves if prev is None else prev))
        return self._auth_events(state, event_type, sender, state_key, content or {})

    def _auth_events(self, state: dict, event_type: str, sender: str, state_key: str | None, content: dict) -> list:
        """What the auth events selection picks from ``state``, in the PDU's form."""
        keys = sorted(auth_types_for(self.room_version, event_type, sender, state_key, content))
        auth_ids = [state[key] for key in keys if key in state]
        return [self._reference(a) for a in auth_ids] if self.ids_in_pdu else auth_ids

    def _reference(self, event_id: str) -> list:
        """A v1/v2 ``prev_events`` item: [ID, its reference hash] (a made-up
        hash for an ID this builder did not build)."""
        return [event_id, {"sha256": self.reference_hashes.get(event_id, "aGFzaA")}]

    def create(self) -> BuiltEvent:
        if not self.room_version.creators_have_infinite_power:
            content: dict[str, Any] = {"creator": self.creator, "room_version": self.version}
        else:
            content = {"room_version": self.version}
            if self.additional_creators:
                content["additional_creators"] = list(self.additional_creators)
        return self.build("m.room.create", self.creator, content, "")

    def power_levels(self, levels: dict[str, int], **kw) -> BuiltEvent:
        """``m.room.power_levels`` giving ``levels`` to users, less the room
        version 12 creators, whose power is infinite and may not be listed."""
        create = self.events[0].event
        creators = room_creators(self.room_version, create) if self.room_version.creators_have_infinite_power else ()
        users = {user: level for user, level in levels.items() if user not in creators}
        return self.state("m.room.power_levels", "", {"users": users, "users_default": 0}, **kw)

    def member(self, user: str, membership: str, sender: str | None = None, **kw) -> BuiltEvent:
        return self.build("m.room.member", sender or user, {"membership": membership}, user, **kw)

    def join(self, user: str, **kw) -> BuiltEvent:
        return self.member(user, "join", **kw)

    def message(self, sender: str, body: str, **kw) -> BuiltEvent:
        return self.build("m.room.message", sender, {"msgtype": "m.text", "body": body}, **kw)

    def state(self, event_type: str, state_key: str, content: dict, sender: str | None = None, **kw) -> BuiltEvent:
        return self.build(event_type, sender or self.creator, content, state_key, **kw)

    def join_rules(self, rule: str = "public", **kw) -> BuiltEvent:
        """``m.room.join_rules``: without it a room is invite-only."""
        return self.state("m.room.join_rules", "", {"join_rule": rule}, **kw)

    def history_visibility(self, value: str, **kw) -> BuiltEvent:
        return self.state("m.room.history_visibility", "", {"history_visibility": value}, **kw)

    def redact(self, sender: str, target: str, **kw) -> BuiltEvent:
        content: dict[str, Any] = {"reason": "spam"}
        extra = None
        if int(self.version) >= 11:
            content["redacts"] = target
        else:
            extra = {"redacts": target}
        return self.build("m.room.redaction", sender, content, extra=extra, **kw)


def _walk_step(
    builder: RoomGraphBuilder,
    rng: random.Random,
    people: list[str],
    members: dict[str, str],
    messages: list[str],
    r: int,
) -> None:
    """One step of a room's random walk: a membership change, a state change, a redaction, a fork merged at once,
    or (most often) a message. ``members`` and ``messages`` are the walk's record, updated here."""
    creator = builder.creator
    roll = rng.random()
    user = rng.choice(people)
    joined = [u for u, m in members.items() if m == "join"]
    if roll < 0.12:
        if members.get(user) not in ("join", "ban"):
            builder.join(user)
            members[user] = "join"
    elif roll < 0.17 and len(joined) > 1:
        leaver = rng.choice([u for u in joined if u != creator] or joined)
        if leaver != creator:
            builder.member(leaver, "leave")
            members[leaver] = "leave"
    elif roll < 0.20:
        if members.get(user) in (None, "leave"):
            builder.member(user, "invite", sender=creator)
            members[user] = "invite"
    elif roll < 0.22 and len(joined) > 2:
        victim = rng.choice([u for u in joined if u != creator])
        builder.member(victim, "leave", sender=creator)  # a kick
        members[victim] = "leave"
    elif roll < 0.23 and len(joined) > 2:
        victim = rng.choice([u for u in joined if u != creator])
        builder.member(victim, "ban", sender=creator)
        members[victim] = "ban"
    elif roll < 0.24:
        builder.history_visibility(rng.choice(["shared", "invited", "joined", "world_readable"]))
    elif roll < 0.26:
        builder.state("m.room.topic", "", {"topic": f"topic {rng.randrange(1000)}"})
    elif roll < 0.28 and messages:
        builder.redact(creator, rng.choice(messages))
    elif roll < 0.29 and joined:
        # A fork whose branches do not conflict (one adds a key the
        # base lacks, the other sends a message), then a merge.
        base = list(builder.leaves)
        key = f"fork{len(builder.events)}"
        a = builder.state("org.example.fork", key, {"n": rng.randrange(1000)}, prev=base)
        b = builder.message(rng.choice(joined), "on the other branch", prev=base)
        builder.leaves = [a.event_id, b.event_id]
        builder.message(rng.choice(joined), "merging the branches")
    else:
        sender = rng.choice(joined)
        messages.append(builder.message(sender, f"message {len(builder.events)} in room {r}").event_id)


def _resolved_fork_ending(builder: RoomGraphBuilder, creator: str) -> None:
    """Two branches set the topic: the merge event's state is their resolution (the store resolves it); then one
    branch goes on."""
    base = list(builder.leaves)
    left = builder.state("m.room.topic", "", {"topic": "left"}, prev=base)
    builder.state("m.room.topic", "", {"topic": "right"}, prev=base)
    builder.message(creator, "after state resolution", prev=builder.leaves, set_leaves=False)
    builder.leaves = [left.event_id]
    builder.message(creator, "continuing on one branch")


def sample_lines(rooms: int = 5, events_per_room: int = 800, users: int = 60, seed: int = 7) -> Iterator[str]:
    """JSON lines of a deterministic multi-room history.

    Each room: create, power levels, the creator's join, then a random walk of
    joins, leaves, invites (some accepted), kicks, bans, messages, topic and
    history visibility changes, and redactions of earlier messages; every
    tenth room event is emitted as a bare PDU (version from its room's create).
    """
    rng = random.Random(seed)
    people = [f"@user{i}:example.org" for i in range(users)]
    versions = ["12", "11", "9", "10", "6"]
    for r in range(rooms):
        creator = people[r % users]
        version = versions[r % len(versions)]
        # A v12 room (the default of today's servers) has a co-founder, whose
        # power is infinite like the creator's; nobody else of the walk is.
        cofounders = [f"@cofounder{r}:example.org"] if version == "12" else []
        builder = RoomGraphBuilder(f"!room{r}:example.org", version, creator, 1_700_000_000_000 + r, cofounders)
        builder.create()
        builder.join(creator)
        builder.power_levels({creator: 100})
        builder.join_rules("public")
        builder.history_visibility("shared")
        members = {creator: "join"}
        messages: list[str] = []
        while len(builder.events) < events_per_room:
            _walk_step(builder, rng, people, members, messages, r)
        if r == rooms - 1:
            _resolved_fork_ending(builder, creator)
        for index, built in enumerate(builder.events):
            if index % 10 == 9:
                yield json.dumps(built.event)
            else:
                yield json.dumps({"room_version": builder.version, "event": built.event})


def write_sample(path: str, **kw) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for line in sample_lines(**kw):
            out.write(line + "\n")
            count += 1
    return count
