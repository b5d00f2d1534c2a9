"""Rooms over HTTP: createRoom with an invite, the invite in the invitee's
initial sync, join, sends with transaction IDs, state, members, history,
redaction, context, and a leave with what the leaver then sees."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.homeserver.harness import HomeserverMixin, quote


@on_both_engines
class RoomTests(HomeserverMixin):
    async def two_users_in_a_room(self):
        await self.start_homeserver()
        alice, bob = await self.register("alice"), await self.register("bob")
        room = (await alice.ok("POST", "/createRoom", {"name": "Tea", "topic": "leaves", "invite": [bob.user_id]}))[
            "room_id"
        ]
        return alice, bob, room

    async def test_invite_join_send_state_members(self):
        alice, bob, room = await self.two_users_in_a_room()
        self.assertRegex(room, r"^![A-Za-z0-9_-]{43}$")  # a room version 12 room: its create event's hash
        initial = await bob.ok("GET", "/sync")
        self.assertEqual(list(initial["rooms"]["invite"]), [room])
        stripped = initial["rooms"]["invite"][room]["invite_state"]["events"]
        self.assertIn(
            {"type": "m.room.name", "state_key": "", "content": {"name": "Tea"}, "sender": alice.user_id}, stripped
        )
        self.assertIn("invite", [e["content"].get("membership") for e in stripped if e["type"] == "m.room.member"])
        self.assertEqual(initial["rooms"]["join"], {})

        self.assertEqual(await bob.ok("POST", f"/join/{quote(room)}", {}), {"room_id": room})
        self.assertEqual(await bob.ok("GET", "/joined_rooms"), {"joined_rooms": [room]})
        first = await alice.send(room, "txn1", "hello")
        self.assertEqual(await alice.send(room, "txn1", "hello again?"), first)  # a retried txnId: the same event
        other = await bob.send(room, "txn1", "hi")  # another user's txnId of the same name: a new event
        self.assertNotEqual(other, first)
        elsewhere = (await alice.ok("POST", "/createRoom", {}))["room_id"]
        self.assertNotEqual(await alice.send(elsewhere, "txn1", "hello"), first)  # a txnId is per room (path)

        await alice.ok("PUT", f"/rooms/{room}/state/m.room.topic/", {"topic": "green"})
        self.assertEqual(await bob.ok("GET", f"/rooms/{room}/state/m.room.topic/"), {"topic": "green"})
        self.assertEqual(await bob.ok("GET", f"/rooms/{room}/state/m.room.topic"), {"topic": "green"})
        state = await bob.ok("GET", f"/rooms/{room}/state")
        self.assertIn(("m.room.topic", ""), {(e["type"], e["state_key"]) for e in state})
        topic = next(e for e in state if e["type"] == "m.room.topic")
        self.assertEqual(topic["unsigned"]["prev_content"], {"topic": "leaves"})
        members = (await bob.ok("GET", f"/rooms/{room}/members"))["chunk"]
        self.assertEqual(
            sorted((e["state_key"], e["content"]["membership"]) for e in members),
            [(alice.user_id, "join"), (bob.user_id, "join")],
        )
        joined = (await alice.ok("GET", f"/rooms/{room}/joined_members"))["joined"]
        self.assertEqual(joined[bob.user_id]["display_name"], "bob")

        # Alice kicks bob; the room is invite only, so he cannot come back by himself.
        await alice.ok("POST", f"/rooms/{room}/kick", {"user_id": bob.user_id, "reason": "tidy"})
        kicked = await alice.ok("GET", f"/rooms/{room}/state/m.room.member/{bob.user_id}")
        self.assertEqual(kicked, {"membership": "leave", "reason": "tidy"})
        status, refused = await bob.call("POST", f"/rooms/{room}/join", {})
        self.assertEqual((status, refused["errcode"]), (403, "M_FORBIDDEN"))
        await alice.ok("POST", f"/rooms/{room}/invite", {"user_id": bob.user_id})
        await bob.ok("POST", f"/rooms/{room}/join", {})
        # Bob may not change the power levels: the room's rules refuse, 403 with the rule.
        status, refused = await bob.call("PUT", f"/rooms/{room}/state/m.room.power_levels/", {"users": {}})
        self.assertEqual((status, refused["errcode"]), (403, "M_FORBIDDEN"))

    async def test_messages_back_pagination_redaction_context(self):
        alice, bob, room = await self.two_users_in_a_room()
        await bob.ok("POST", f"/rooms/{room}/join", {})
        sent = [await alice.send(room, f"t{i}", f"message {i}") for i in range(30)]
        seen, token = [], None
        while True:
            query = {"dir": "b", "limit": "7", **({"from": token} if token else {})}
            page = await bob.ok("GET", f"/rooms/{room}/messages", query=query)
            seen += [e["event_id"] for e in page["chunk"] if e["type"] == "m.room.message"]
            if "end" not in page:
                break
            token = page["end"]
        self.assertEqual(seen, sent[::-1])  # every message, newest first

        only = await bob.ok(
            "GET", f"/rooms/{room}/messages", query={"dir": "b", "limit": "3", "filter": '{"types": ["m.room.member"]}'}
        )
        self.assertEqual({e["type"] for e in only["chunk"]}, {"m.room.member"})

        redaction = (await alice.ok("PUT", f"/rooms/{room}/redact/{quote(sent[5])}/r1", {"reason": "typo"}))["event_id"]
        again = (await alice.ok("PUT", f"/rooms/{room}/redact/{quote(sent[5])}/r1", {"reason": "typo"}))["event_id"]
        self.assertEqual(again, redaction)
        redacted = await bob.ok("GET", f"/rooms/{room}/event/{quote(sent[5])}")
        self.assertEqual(redacted["content"], {})
        self.assertEqual(redacted["unsigned"]["redacted_because"]["event_id"], redaction)
        served = await bob.ok("GET", f"/rooms/{room}/event/{quote(redaction)}")
        # Room version 12 keeps redacts in content; clients also find it at the top, as Synapse serves it.
        self.assertEqual((served["content"]["redacts"], served["redacts"]), (sent[5], sent[5]))

        context = await bob.ok("GET", f"/rooms/{room}/context/{quote(sent[10])}", query={"limit": "2"})
        self.assertEqual(context["event"]["event_id"], sent[10])
        self.assertEqual([e["event_id"] for e in context["events_before"]], [sent[9], sent[8]])
        self.assertEqual([e["event_id"] for e in context["events_after"]], [sent[11], sent[12]])
        self.assertIn("m.room.create", {e["type"] for e in context["state"]})

    async def test_leave_and_what_the_leaver_sees(self):
        alice, bob, room = await self.two_users_in_a_room()
        await bob.ok("POST", f"/rooms/{room}/join", {})
        before = await alice.send(room, "a", "while bob is here")
        since = (await bob.ok("GET", "/sync"))["next_batch"]
        await bob.ok("POST", f"/rooms/{room}/leave", {})
        await alice.ok("PUT", f"/rooms/{room}/state/m.room.name/", {"name": "Secret"})
        after = await alice.send(room, "b", "after bob left")

        synced = await bob.ok("GET", "/sync", query={"since": since})
        self.assertEqual(synced["rooms"]["join"], {})
        left = synced["rooms"]["leave"][room]["timeline"]["events"]
        self.assertEqual((left[-1]["type"], left[-1]["content"]["membership"]), ("m.room.member", "leave"))
        self.assertEqual(await bob.ok("GET", "/joined_rooms"), {"joined_rooms": []})
        page = await bob.ok("GET", f"/rooms/{room}/messages", query={"dir": "b", "limit": "50"})
        ids = [e["event_id"] for e in page["chunk"]]
        self.assertIn(before, ids)
        self.assertNotIn(after, ids)
        # The state as it was when bob left: the old name.
        self.assertEqual(await bob.ok("GET", f"/rooms/{room}/state/m.room.name/"), {"name": "Tea"})
        status, refused = await bob.call("PUT", f"/rooms/{room}/send/m.room.message/c", {"body": "let me in"})
        self.assertEqual((status, refused["errcode"]), (403, "M_FORBIDDEN"))
        # Alice kicks nobody in the room now; bans bob, who cannot join again.
        await alice.ok("POST", f"/rooms/{room}/ban", {"user_id": bob.user_id, "reason": "bye"})
        status, refused = await bob.call("POST", f"/rooms/{room}/join", {})
        self.assertEqual((status, refused["errcode"]), (403, "M_FORBIDDEN"))
