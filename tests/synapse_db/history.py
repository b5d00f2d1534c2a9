"""The history the import tests make on a real Synapse through its client API.

Three rooms: one at Synapse's default room version (12) and one at 10, with
several users: invites, joins, leaves, kicks, bans, history-visibility
changes through all four settings, topic and power-level changes,
redactions, and a few hundred messages; and a third (v12) whose DAG forks,
its events sent concurrently, with conflicting topic changes. ``build`` returns what it made as
JSON (room IDs, users with their access tokens, the events whose visibility
the tests name) so every test process reads the same history.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from tests.synapse_server import SynapseServer, SynapseUser

USERS = ("alice", "bob", "carol", "dave", "eve", "frank")


def _talk(users: list[SynapseUser], room_id: str, count: int, tag: str) -> list[str]:
    return [users[i % len(users)].send(room_id, f"{tag} {i}") for i in range(count)]


def _hv(user: SynapseUser, room_id: str, setting: str) -> str:
    return user.state(room_id, "m.room.history_visibility", {"history_visibility": setting})


def build(server: SynapseServer) -> dict:
    suffix = os.urandom(3).hex()
    users = {name: server.register(f"{name}{suffix}", admin=name == "alice") for name in USERS}
    alice, bob, carol, dave, eve = (users[n] for n in USERS[:5])
    marks: dict[str, str] = {}

    # A v12 room (Synapse's default): private, history starts "shared".
    main = alice.create_room(name="main", topic="the first topic")
    alice.invite(main, bob.user_id)
    bob.join(main)
    power = alice.get_state(main, "m.room.power_levels")
    power.setdefault("users", {})[bob.user_id] = 50
    alice.state(main, "m.room.power_levels", power)
    _talk([alice, bob], main, 30, "shared")
    _hv(alice, main, "invited")
    _talk([alice, bob], main, 10, "invited")
    alice.invite(main, carol.user_id)
    _talk([alice, bob], main, 10, "carol invited")
    marks["invited_to_joined"] = _hv(alice, main, "joined")
    _talk([alice, bob], main, 10, "joined, carol still invited")
    carol.join(main)
    carol_said = _talk([alice, bob, carol], main, 18, "carol in")
    alice.kick(main, carol.user_id)
    _talk([alice, bob], main, 5, "after the kick")
    alice.invite(main, dave.user_id)
    dave.join(main)
    _talk([alice, bob, dave], main, 6, "dave in")
    alice.ban(main, dave.user_id)
    _hv(alice, main, "world_readable")
    bob_said = _talk([alice, bob], main, 12, "world readable")
    bob.redact(main, bob_said[1], "mine")
    alice.redact(main, carol_said[2], "moderation")
    alice.state(main, "m.room.topic", {"topic": "the second topic"})
    power = alice.get_state(main, "m.room.power_levels")
    power["events_default"] = 0
    power["users"][bob.user_id] = 75
    alice.state(main, "m.room.power_levels", power)
    _hv(alice, main, "shared")
    _talk([alice, bob], main, 10, "shared again")
    bob.leave(main)
    alice.unban(main, dave.user_id)
    alice.invite(main, eve.user_id)
    eve.join(main)
    _talk([alice, eve], main, 20, "eve in")

    # A v10 room: public, people come and go.
    second = alice.create_room(room_version="10", preset="public_chat", name="second")
    for user in (bob, carol, eve):
        user.join(second)
    said = _talk([alice, bob, carol, eve], second, 36, "public shared")
    _hv(alice, second, "joined")
    _talk([alice, bob, carol, eve], second, 12, "public joined")
    carol.leave(second)
    dave.join(second)
    _talk([alice, bob, dave, eve], second, 12, "dave joined")
    _hv(alice, second, "invited")
    alice.kick(second, eve.user_id)
    alice.redact(second, said[3], "cleanup")
    bob.redact(second, said[5])
    alice.state(second, "m.room.topic", {"topic": "second's topic"})
    _hv(alice, second, "world_readable")
    _talk([alice, bob, dave], second, 12, "public world readable")
    alice.ban(second, bob.user_id, "enough")
    carol.join(second)
    _talk([alice, carol, dave], second, 20, "carol back")

    # A room whose DAG forks: messages and topic changes sent concurrently
    # (Synapse creates up to five events of a room at once), so events have
    # several prev events and the branches' topics conflict: Synapse resolves
    # them, roomstore must take its answer.
    forked = alice.create_room(preset="public_chat", name="forked")
    for user in (bob, carol):
        user.join(forked)
    power = alice.get_state(forked, "m.room.power_levels")
    power["users"].update({bob.user_id: 100, carol.user_id: 100})
    alice.state(forked, "m.room.power_levels", power)

    def concurrent(i: int) -> str:
        user = (alice, bob, carol)[i % 3]
        if i % 4 == 0:
            return user.state(forked, "m.room.topic", {"topic": f"topic {i}"})
        return user.send(forked, f"concurrent {i}")

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(concurrent, range(90)))

    return {
        "rooms": {"main": main, "second": second, "forked": forked},
        "users": {name: {"user_id": u.user_id, "token": u.token} for name, u in users.items()},
        "marks": marks,
    }


def users_of(server: SynapseServer, history: dict) -> dict[str, SynapseUser]:
    return {name: SynapseUser(server, u["user_id"], u["token"]) for name, u in history["users"].items()}
