"""The admin API (``roomstore/homeserver/admin.py``) on both engines: who may
call it, and a room's history purged, then the room deleted, while two
matrix-nio clients (``nio_live.py``, a process) keep syncing and sending."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.internet import threads

from roomstore.events import TopologicalToken
from tests.db import on_both_engines
from tests.homeserver.harness import Client, HomeserverMixin, quote, sleep

LIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nio_live.py")
ADMIN = "/_synapse/admin"


async def wait_done(client: Client, path: str) -> dict:
    """Poll a purge's status until it is no longer active."""
    for _ in range(600):
        answer = await client.ok("GET", path, prefix=ADMIN)
        if answer["status"] != "active":
            return answer
        await sleep(0.05)
    raise AssertionError(f"{path} still active")


@on_both_engines
class AdminTests(HomeserverMixin):
    async def test_only_admins(self):
        await self.start_homeserver()
        alice, bob = await self.register("alice"), await self.register("bob")
        room = (await alice.ok("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
        first = await alice.send(room, "t0", "hello")
        body = {"purge_up_to_event_id": first}
        status, answer = await bob.call("POST", f"/v1/purge_history/{quote(room)}", body, prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (403, "M_FORBIDDEN"))
        status, answer = await bob.call("DELETE", f"/v2/rooms/{quote(room)}", {}, prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (403, "M_FORBIDDEN"))
        self.assertTrue(await self.hs.accounts.set_admin(bob.user_id))
        self.assertFalse(await self.hs.accounts.set_admin("@nobody:test.local"))
        status, answer = await bob.call("POST", f"/v1/purge_history/{quote(room)}", {}, prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (400, "M_BAD_JSON"))
        status, answer = await bob.call("GET", "/v1/purge_history_status/nope", prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (404, "M_NOT_FOUND"))
        # Up to a time: nothing was sent before 1 ms; everything before now goes but what the room needs.
        path = f"/v1/purge_history/{quote(room)}"
        status, answer = await bob.call("POST", path, {"purge_up_to_ts": 1}, prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (404, "M_NOT_FOUND"))
        status, answer = await bob.call("POST", path, {"purge_up_to_ts": "soon"}, prefix=ADMIN)
        self.assertEqual((status, answer["errcode"]), (400, "M_BAD_JSON"))
        purge = await bob.ok("POST", path, {"purge_up_to_ts": 2**53}, prefix=ADMIN)
        status = await wait_done(bob, f"/v1/purge_history_status/{purge['purge_id']}")
        self.assertEqual(status["status"], "complete", status)
        # Local events (every one here) stay as outliers unless delete_local_events says otherwise.
        self.assertGreater(status["events_made_outliers"], 0, status)

    async def test_purge_beside_live_clients(self):
        base = await self.start_homeserver()
        live = subprocess.Popen(
            [sys.executable, LIVE, base],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.addCleanup(lambda: live.poll() is None and live.kill())
        ready = json.loads(await threads.deferToThread(live.stdout.readline))
        self.assertIn("ready", ready, ready)
        room = ready["ready"]["room_id"]
        alice = Client(self.base, ready["ready"]["alice"][1], ready["ready"]["alice"][0])
        bob = Client(self.base, ready["ready"]["bob"][1], ready["ready"]["bob"][0])
        await self.hs.accounts.set_admin(alice.user_id)
        store = self.hs.store

        # Every event of the room before, oldest first, and the state at each.
        page = await alice.ok("GET", f"/rooms/{quote(room)}/messages", query={"dir": "f", "limit": "1000"})
        events = [e["event_id"] for e in page["chunk"]]
        state_before = {event_id: await store.get_state_ids(event_id) for event_id in events}
        messages = [e["event_id"] for e in page["chunk"] if e["type"] == "m.room.message"]
        point = messages[len(messages) // 2]

        await sleep(0.5)  # the clients are syncing and sending now
        purge = await alice.ok(
            "POST",
            f"/v1/purge_history/{quote(room)}",
            {"purge_up_to_event_id": point, "delete_local_events": True},
            prefix=ADMIN,
        )
        status = await wait_done(alice, f"/v1/purge_history_status/{purge['purge_id']}")
        self.assertEqual(status["status"], "complete", status)
        self.assertEqual(status["room_id"], room)
        self.assertGreater(status["rows_deleted"].get("events", 0), 0, status)
        await sleep(0.5)  # and go on after it

        # The events before the point are gone from the timeline; every one left has the state it had.
        flags = await store.get_event_flags(events)
        kept = [e for e in events if e in flags and not flags[e].outlier]
        self.assertIn(point, kept)
        self.assertNotIn(messages[0], kept)
        for event_id in kept:
            self.assertEqual(await store.get_state_ids(event_id), state_before[event_id], event_id)

        # The clients go on: a send reaches the other's long-poll, paging back ends at the purge point.
        live.stdin.write("check\n")
        live.stdin.flush()
        out = await threads.deferToThread(live.communicate, timeout=120)
        lines = [json.loads(line) for line in out[0].splitlines() if line.startswith("{")]
        self.assertEqual(live.returncode, 0, f"{lines[-1:]} {out[1][-2000:]}")
        done = lines[-1]["done"]
        self.assertGreater(done["counts"]["alice"]["sent"] + done["counts"]["bob"]["sent"], 0)
        self.assertLess(done["woken_s"], 5)
        paged = done["paged_back"]
        self.assertIn(point, paged)
        self.assertFalse(set(paged) & set(messages[: len(messages) // 2]))
        point_at = TopologicalToken.parse(await store.get_topological_token(point)).as_tuple()
        for event_id in paged:
            if event_id in flags and not flags[event_id].outlier:
                self.assertGreaterEqual(
                    TopologicalToken.parse(await store.get_topological_token(event_id)).as_tuple(), point_at
                )

        # The room deleted: gone from /joined_rooms and from sync.
        self.assertIn(room, (await bob.ok("GET", "/joined_rooms"))["joined_rooms"])
        delete = await alice.ok("DELETE", f"/v2/rooms/{quote(room)}", {}, prefix=ADMIN)
        deleted = await wait_done(alice, f"/v2/rooms/delete_status/{delete['delete_id']}")
        self.assertEqual(deleted["status"], "complete", deleted)
        self.assertGreater(deleted["purge"]["rows_deleted"]["events"], 0)
        by_room = await alice.ok("GET", f"/v2/rooms/{quote(room)}/delete_status", prefix=ADMIN)
        self.assertEqual([r["delete_id"] for r in by_room["results"]], [delete["delete_id"]])
        for client in (alice, bob):
            self.assertNotIn(room, (await client.ok("GET", "/joined_rooms"))["joined_rooms"])
            synced = await client.ok("GET", "/sync")
            self.assertNotIn(room, synced["rooms"]["join"])
