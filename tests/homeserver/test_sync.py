"""/sync over HTTP: a limited timeline with prev_batch that pages back over
everything, an incremental sync woken by a send, filters, full_state."""

from __future__ import annotations

import json

from twisted.internet import defer

from tests.db import on_both_engines
from tests.homeserver.harness import HomeserverMixin, monotonic, quote, sleep


@on_both_engines
class SyncTests(HomeserverMixin):
    async def room_with_messages(self, count: int):
        await self.start_homeserver()
        alice, bob = await self.register("alice"), await self.register("bob")
        room = (await alice.ok("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
        await bob.ok("POST", f"/join/{room}", {})
        sent = [await alice.send(room, f"t{i}", f"m{i}") for i in range(count)]
        return alice, bob, room, sent

    async def test_limited_sync_and_prev_batch(self):
        alice, bob, room, sent = await self.room_with_messages(12)
        sync_filter = json.dumps({"room": {"timeline": {"limit": 5}}})
        synced = await bob.ok("GET", "/sync", query={"filter": sync_filter})
        joined = synced["rooms"]["join"][room]
        timeline = joined["timeline"]
        self.assertTrue(timeline["limited"])
        self.assertEqual([e["event_id"] for e in timeline["events"]], sent[-5:])
        state_types = {e["type"] for e in joined["state"]["events"]}
        self.assertTrue({"m.room.create", "m.room.power_levels", "m.room.member"} <= state_types)
        older, token = [], timeline["prev_batch"]
        while token:
            page = await bob.ok("GET", f"/rooms/{room}/messages", query={"dir": "b", "from": token, "limit": "4"})
            older += [e["event_id"] for e in page["chunk"] if e["type"] == "m.room.message"]
            token = page.get("end")
        self.assertEqual(older, sent[:-5][::-1])  # the rest, newest first, none twice

        # An incremental sync with more new events than the limit is limited too.
        for i in range(4):
            await alice.send(room, f"u{i}", f"n{i}")
        again = await bob.ok(
            "GET",
            "/sync",
            query={"since": synced["next_batch"], "filter": json.dumps({"room": {"timeline": {"limit": 2}}})},
        )
        self.assertTrue(again["rooms"]["join"][room]["timeline"]["limited"])
        self.assertEqual(
            [e["content"]["body"] for e in again["rooms"]["join"][room]["timeline"]["events"]], ["n2", "n3"]
        )

        # A stored filter, by ID: only messages, and no more than one.
        stored = {"room": {"timeline": {"limit": 1, "types": ["m.room.message"]}}}
        filter_id = (await bob.ok("POST", f"/user/{bob.user_id}/filter", stored))["filter_id"]
        self.assertEqual(await bob.ok("GET", f"/user/{bob.user_id}/filter/{filter_id}"), stored)
        one = await bob.ok("GET", "/sync", query={"filter": filter_id})
        self.assertEqual([e["content"]["body"] for e in one["rooms"]["join"][room]["timeline"]["events"]], ["n3"])

    async def test_incremental_sync_is_woken_by_a_send(self):
        alice, bob, room, sent = await self.room_with_messages(1)
        since = (await bob.ok("GET", "/sync"))["next_batch"]
        quiet = await bob.ok("GET", "/sync", query={"since": since, "timeout": "200"})
        self.assertEqual(quiet["rooms"]["join"], {})
        started = monotonic()
        waiting = defer.ensureDeferred(bob.ok("GET", "/sync", query={"since": since, "timeout": "20000"}))
        await sleep(0.3)
        self.assertFalse(waiting.called)
        event_id = await alice.send(room, "late", "wake up")
        woken = await waiting
        self.assertLess(monotonic() - started, 1.3)  # the 0.3 s wait, then within a second of the send
        events = woken["rooms"]["join"][room]["timeline"]["events"]
        self.assertEqual([e["event_id"] for e in events], [event_id])
        self.assertFalse(woken["rooms"]["join"][room]["timeline"]["limited"])

    async def test_full_state_and_invite_in_incremental_sync(self):
        alice, bob, room, _ = await self.room_with_messages(2)
        carol = await self.register("carol")
        since = (await carol.ok("GET", "/sync"))["next_batch"]
        await alice.ok("POST", f"/rooms/{room}/invite", {"user_id": carol.user_id})
        invited = await carol.ok("GET", "/sync", query={"since": since, "timeout": "5000"})
        self.assertEqual(list(invited["rooms"]["invite"]), [room])
        await carol.ok("POST", f"/rooms/{room}/join", {})
        joined = await carol.ok("GET", "/sync", query={"since": invited["next_batch"]})
        # A room joined since the last sync comes with its state.
        state = joined["rooms"]["join"][room]["state"]["events"] + joined["rooms"]["join"][room]["timeline"]["events"]
        self.assertIn("m.room.create", {e["type"] for e in state})
        full = await bob.ok("GET", "/sync", query={"since": joined["next_batch"], "full_state": "true"})
        self.assertIn("m.room.create", {e["type"] for e in full["rooms"]["join"][room]["state"]["events"]})


@on_both_engines
class TransactionIdTests(HomeserverMixin):
    async def test_the_sending_device_alone_gets_its_txn_ids_back(self):
        """``unsigned.transaction_id``: the client's own txnId, on the events
        its device sent (sync, /messages, /context, /event), for no one else."""
        await self.start_homeserver()
        alice, bob = await self.register("alice"), await self.register("bob")
        room = (await alice.ok("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
        await bob.ok("POST", f"/join/{room}", {})
        message = await alice.send(room, quote("a/slash"), "hello")  # a txnId may hold anything, a slash too
        redaction = (await alice.ok("PUT", f"/rooms/{room}/redact/{message}/r1", {}))["event_id"]
        login = await alice.ok(
            "POST",
            "/login",
            {"type": "m.login.password", "password": "secret", "identifier": {"type": "m.id.user", "user": "alice"}},
        )
        laptop = type(alice)(alice.base, login["access_token"], alice.user_id)

        def txn_ids(events):
            return {
                e["event_id"]: e["unsigned"]["transaction_id"]
                for e in events
                if "transaction_id" in e.get("unsigned", {})
            }

        synced = await alice.ok("GET", "/sync")
        self.assertEqual(
            txn_ids(synced["rooms"]["join"][room]["timeline"]["events"]), {message: "a/slash", redaction: "r1"}
        )
        page = await alice.ok("GET", f"/rooms/{room}/messages", query={"dir": "b"})
        self.assertEqual(txn_ids(page["chunk"]), {message: "a/slash", redaction: "r1"})
        context = await alice.ok("GET", f"/rooms/{room}/context/{redaction}")
        self.assertEqual(context["event"]["unsigned"]["transaction_id"], "r1")
        event = await alice.ok("GET", f"/rooms/{room}/event/{message}")
        self.assertEqual(event["unsigned"]["transaction_id"], "a/slash")
        for other in (bob, laptop):  # another user; the same user on another device
            self.assertEqual(txn_ids((await other.ok("GET", "/sync"))["rooms"]["join"][room]["timeline"]["events"]), {})
            self.assertEqual(
                txn_ids((await other.ok("GET", f"/rooms/{room}/messages", query={"dir": "b"}))["chunk"]), {}
            )
