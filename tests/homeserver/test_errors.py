"""The spec's error JSON, with the right status, over HTTP."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.homeserver.harness import Client, HomeserverMixin, quote


@on_both_engines
class ErrorTests(HomeserverMixin):
    async def test_errors(self):
        base = await self.start_homeserver()
        alice, mallory = await self.register("alice"), await self.register("mallory")
        room = (await alice.ok("POST", "/createRoom", {}))["room_id"]

        async def expect(client, status, errcode, method, path, body=None, **kwargs):
            got_status, answer = await client.call(method, path, body, **kwargs)
            self.assertEqual((got_status, answer["errcode"]), (status, errcode), f"{method} {path}: {answer}")
            self.assertIsInstance(answer["error"], str)
            self.assertNotIn("\n", answer["error"])
            return answer

        # An event the room's rules reject: 403 with the rule broken.
        refused = await expect(
            mallory, 403, "M_FORBIDDEN", "PUT", f"/rooms/{room}/send/m.room.message/1", {"body": "x"}
        )
        self.assertIn("rule", refused["error"])
        await expect(mallory, 403, "M_FORBIDDEN", "POST", f"/rooms/{room}/join", {})  # invite only
        await expect(mallory, 403, "M_FORBIDDEN", "GET", f"/rooms/{room}/state")
        await expect(Client(base, "syt_nonsense"), 401, "M_UNKNOWN_TOKEN", "GET", "/sync")
        await expect(Client(base), 401, "M_MISSING_TOKEN", "GET", "/joined_rooms")
        await expect(alice, 404, "M_NOT_FOUND", "GET", "/rooms/!nowhere:test.local/state/m.room.name/")
        await expect(alice, 404, "M_NOT_FOUND", "GET", f"/rooms/{room}/state/m.room.avatar/")
        await expect(alice, 404, "M_NOT_FOUND", "GET", f"/user/{alice.user_id}/filter/99")
        await expect(alice, 403, "M_FORBIDDEN", "GET", f"/user/{mallory.user_id}/filter/0")
        await expect(alice, 404, "M_NOT_FOUND", "POST", f"/join/{quote('#alias:test.local')}", {})
        await expect(alice, 404, "M_UNRECOGNIZED", "GET", "/no/such/endpoint")
        await expect(alice, 404, "M_UNRECOGNIZED", "GET", "/anything", prefix="/_matrix/media/v3")
        await expect(alice, 405, "M_UNRECOGNIZED", "DELETE", "/createRoom")
        await expect(alice, 400, "M_NOT_JSON", "POST", "/createRoom", raw=b"{not json")
        await expect(alice, 400, "M_BAD_JSON", "POST", "/createRoom", raw=b"[1, 2]")
        await expect(alice, 400, "M_BAD_JSON", "POST", "/createRoom", {"invite": "not a list"})
        await expect(alice, 400, "M_UNSUPPORTED_ROOM_VERSION", "POST", "/createRoom", {"room_version": "99"})
        await expect(alice, 400, "M_INVALID_PARAM", "GET", "/sync", query={"since": "s999999"})
        await expect(alice, 400, "M_INVALID_PARAM", "GET", f"/rooms/{room}/messages", query={"from": "garbage"})
        await expect(alice, 400, "M_INVALID_PARAM", "GET", f"/rooms/{room}/messages", query={"dir": "x"})
        # A room of an older version works as well.
        old = (await alice.ok("POST", "/createRoom", {"room_version": "10", "name": "ten"}))["room_id"]
        self.assertTrue(old.endswith(":test.local"))
        await alice.send(old, "1", "in a version 10 room")
