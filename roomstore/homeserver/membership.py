"""Membership changes a client asks for: ``/join``, ``/rooms/{id}/join``,
``invite``, ``leave``, ``kick``, ``ban``, ``unban``, ``forget``, and
``/joined_rooms``. Each is one ``m.room.member`` event; whether it is
allowed is the room's authorization rules' answer (403 ``M_FORBIDDEN`` with
the rule when they refuse)."""

from __future__ import annotations

from roomstore.homeserver.errors import MatrixError, bad_json, not_found
from roomstore.homeserver.events import EventCreator
from roomstore.homeserver.http import ClientRequest, Router

__all__ = ["Memberships"]


class Memberships:
    def __init__(self, events: EventCreator, profile_of):
        self._events = events
        self._profile_of = profile_of  # async user_id -> {"displayname", "avatar_url"}

    def register_routes(self, router: Router) -> None:
        router.add("POST", "/join/{roomIdOrAlias}", self.join)
        router.add("POST", "/rooms/{roomId}/join", self.join)
        router.add("POST", "/rooms/{roomId}/invite", self.invite)
        router.add("POST", "/rooms/{roomId}/leave", self.leave)
        router.add("POST", "/rooms/{roomId}/kick", self.kick)
        router.add("POST", "/rooms/{roomId}/ban", self.ban)
        router.add("POST", "/rooms/{roomId}/unban", self.unban)
        router.add("POST", "/rooms/{roomId}/forget", self.forget)
        router.add("GET", "/joined_rooms", self.joined_rooms)

    async def _member_event(self, request: ClientRequest, target: str, membership: str) -> str:
        room_id = request.params.get("roomId") or request.params["roomIdOrAlias"]
        if not room_id.startswith("!"):
            raise not_found(f"Unknown room {room_id}: this server resolves no aliases")
        content = {"membership": membership}
        reason = request.body.get("reason")
        if isinstance(reason, str):
            content["reason"] = reason
        if membership == "join":
            content.update(await self._profile_of(target))
        return await self._events.send(room_id, request.user.user_id, "m.room.member", content, state_key=target)

    def _target(self, request: ClientRequest) -> str:
        target = request.body.get("user_id")
        if not isinstance(target, str) or not target.startswith("@") or ":" not in target:
            raise bad_json("user_id must be a user ID")
        if target.partition(":")[2] != self._events.server_name:
            raise MatrixError(403, "M_FORBIDDEN", f"{target} is on another server: this server does not federate")
        return target

    async def join(self, request: ClientRequest) -> dict:
        await self._member_event(request, request.user.user_id, "join")
        return {"room_id": request.params.get("roomId") or request.params["roomIdOrAlias"]}

    async def invite(self, request: ClientRequest) -> dict:
        await self._member_event(request, self._target(request), "invite")
        return {}

    async def leave(self, request: ClientRequest) -> dict:
        await self._member_event(request, request.user.user_id, "leave")
        return {}

    async def kick(self, request: ClientRequest) -> dict:
        await self._member_event(request, self._target(request), "leave")
        return {}

    async def ban(self, request: ClientRequest) -> dict:
        await self._member_event(request, self._target(request), "ban")
        return {}

    async def unban(self, request: ClientRequest) -> dict:
        await self._member_event(request, self._target(request), "leave")
        return {}

    async def forget(self, request: ClientRequest) -> dict:
        return {}  # nothing is hidden from a user who left: forgetting changes nothing here

    async def joined_rooms(self, request: ClientRequest) -> dict:
        return {"joined_rooms": sorted(await self._events.store.get_rooms_for_user(request.user.user_id))}
