"""Profiles: ``GET /profile/{userId}``, ``GET``/``PUT``
``/profile/{userId}/displayname`` and ``.../avatar_url`` (``hs_profiles``).

A new account's display name is its localpart. A change is copied into the
user's member event in every room they are joined to (a new join event with
the new profile), as clients show a member's name from that event."""

from __future__ import annotations

from twisted.logger import Logger

from roomstore.homeserver.errors import MatrixError, bad_json, forbidden, not_found
from roomstore.homeserver.events import EventCreator
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.homeserver.tables import accounts, profiles

__all__ = ["Profiles"]

log = Logger()


class Profiles:
    def __init__(self, db, events: EventCreator):
        self._db = db
        self._events = events

    def register_routes(self, router: Router) -> None:
        router.add("GET", "/profile/{userId}", self.get_profile, authenticated=False)
        for field in profiles.FIELDS:
            router.add("GET", f"/profile/{{userId}}/{field}", self._getter(field), authenticated=False)
            router.add("PUT", f"/profile/{{userId}}/{field}", self._setter(field))

    async def profile_of(self, user_id: str) -> dict:
        """The user's profile fields that are set (``{}`` for none)."""
        return await self._db.run_interaction("hs_get_profile", profiles.get_profile_txn, user_id) or {}

    async def set_field(self, user_id: str, field: str, value: str | None) -> None:
        await self._db.run_interaction("hs_set_profile", profiles.set_profile_field_txn, user_id, field, value)

    async def get_profile(self, request: ClientRequest) -> dict:
        user_id = request.params["userId"]
        if not await self._db.run_interaction("hs_user_exists", accounts.user_exists_txn, user_id):
            raise not_found("Profile was not found")
        return await self.profile_of(user_id)

    def _getter(self, field: str):
        async def get(request: ClientRequest) -> dict:
            profile = await self.get_profile(request)
            if field not in profile:
                raise not_found(f"The user has no {field}")
            return {field: profile[field]}

        return get

    def _setter(self, field: str):
        async def put(request: ClientRequest) -> dict:
            user_id = request.params["userId"]
            if user_id != request.user.user_id:
                raise forbidden("Cannot set another user's profile")
            value = request.body.get(field)
            if value is not None and not isinstance(value, str):
                raise bad_json(f"{field} must be a string")
            await self.set_field(user_id, field, value)
            await self._update_member_events(user_id)
            return {}

        return put

    async def _update_member_events(self, user_id: str) -> None:
        profile = await self.profile_of(user_id)
        for room_id in sorted(await self._events.store.get_rooms_for_user(user_id)):
            try:
                await self._events.send(
                    room_id, user_id, "m.room.member", {"membership": "join", **profile}, state_key=user_id
                )
            except MatrixError as exc:  # a room whose rules refuse it keeps the old name
                log.warn("profile change not copied to {room}: {error}", room=room_id, error=exc.error)
