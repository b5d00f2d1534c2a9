"""Accounts over HTTP: register, login, whoami, logout, and the token errors."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.homeserver.harness import Client, HomeserverMixin


@on_both_engines
class AccountTests(HomeserverMixin):
    async def test_register_login_whoami_logout(self):
        base = await self.start_homeserver()
        anonymous = Client(base)
        status, flows = await anonymous.call("POST", "/register", {"username": "alice", "password": "pw"})
        self.assertEqual(status, 401)
        self.assertEqual(flows["flows"], [{"stages": ["m.login.dummy"]}])
        alice = await self.register("alice", "pw")
        self.assertEqual(alice.user_id, "@alice:test.local")
        status, taken = await anonymous.call(
            "POST", "/register", {"username": "alice", "password": "x", "auth": {"type": "m.login.dummy"}}
        )
        self.assertEqual((status, taken["errcode"]), (400, "M_USER_IN_USE"))
        whoami = await alice.ok("GET", "/account/whoami")
        self.assertEqual(whoami["user_id"], "@alice:test.local")

        login = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": "alice"}, "password": "pw"}
        session = await anonymous.ok("POST", "/login", login)
        self.assertNotEqual(session["access_token"], alice.token)
        second = Client(base, session["access_token"])
        self.assertEqual((await second.ok("GET", "/account/whoami"))["device_id"], session["device_id"])
        status, wrong = await anonymous.call("POST", "/login", {**login, "password": "nope"})
        self.assertEqual((status, wrong["errcode"]), (403, "M_FORBIDDEN"))
        self.assertEqual((await anonymous.ok("GET", "/login"))["flows"], [{"type": "m.login.password"}])

        await second.ok("POST", "/logout", {})
        status, gone = await second.call("GET", "/account/whoami")
        self.assertEqual((status, gone["errcode"]), (401, "M_UNKNOWN_TOKEN"))
        self.assertEqual((await alice.ok("GET", "/account/whoami"))["user_id"], alice.user_id)  # still logged in
        status, missing = await anonymous.call("GET", "/account/whoami")
        self.assertEqual((status, missing["errcode"]), (401, "M_MISSING_TOKEN"))

    async def test_versions_capabilities_pushrules_profile(self):
        base = await self.start_homeserver()
        versions = await Client(base).ok("GET", "/versions", prefix="/_matrix/client")
        self.assertIn("v1.11", versions["versions"])
        alice = await self.register("alice")
        capabilities = (await alice.ok("GET", "/capabilities"))["capabilities"]
        self.assertEqual(capabilities["m.room_versions"]["default"], "12")
        rules = (await alice.ok("GET", "/pushrules/"))["global"]
        self.assertEqual(rules["override"][0]["rule_id"], ".m.rule.master")
        self.assertEqual(rules["content"][0]["pattern"], "alice")
        self.assertEqual([r["rule_id"] for r in rules["underride"]][-2:], [".m.rule.message", ".m.rule.encrypted"])
        self.assertEqual(await alice.ok("GET", "/profile/@alice:test.local"), {"displayname": "alice"})
        room = (await alice.ok("POST", "/createRoom", {}))["room_id"]
        await alice.ok("PUT", "/profile/@alice:test.local/displayname", {"displayname": "Alice A."})
        self.assertEqual(await alice.ok("GET", "/profile/@alice:test.local/displayname"), {"displayname": "Alice A."})
        member = await alice.ok("GET", f"/rooms/{room}/state/m.room.member/@alice:test.local")
        self.assertEqual(member, {"membership": "join", "displayname": "Alice A."})
