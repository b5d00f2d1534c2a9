"""What the server offers: ``GET /versions`` (open), ``GET /capabilities``,
and the few endpoints a client calls on start that this server answers with
nothing (no end-to-end encryption keys, typing, receipts, presence or
account data are kept): they succeed, so a client starts, and store nothing."""

from __future__ import annotations

from roomstore.homeserver.create_room import DEFAULT_ROOM_VERSION, SUPPORTED_ROOM_VERSIONS
from roomstore.homeserver.http import ClientRequest, Router

__all__ = ["ServerInfo"]

SPEC_VERSIONS = ("r0.6.1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5", "v1.6", "v1.7", "v1.8", "v1.9", "v1.10", "v1.11")


class ServerInfo:
    def register_routes(self, router: Router) -> None:
        router.add("GET", "/versions", self.versions, authenticated=False)
        router.add("GET", "/capabilities", self.capabilities)
        router.add("POST", "/keys/upload", self.keys_upload)
        router.add("POST", "/keys/query", self.keys_query)
        router.add("PUT", "/rooms/{roomId}/typing/{userId}", self.nothing)
        router.add("POST", "/rooms/{roomId}/receipt/{receiptType}/{eventId}", self.nothing)
        router.add("POST", "/rooms/{roomId}/read_markers", self.nothing)
        router.add("PUT", "/presence/{userId}/status", self.nothing)
        router.add("PUT", "/user/{userId}/account_data/{type}", self.nothing)

    async def versions(self, request: ClientRequest) -> dict:
        return {"versions": list(SPEC_VERSIONS), "unstable_features": {}}

    async def capabilities(self, request: ClientRequest) -> dict:
        return {
            "capabilities": {
                "m.room_versions": {
                    "default": DEFAULT_ROOM_VERSION,
                    "available": {version: "stable" for version in SUPPORTED_ROOM_VERSIONS},
                },
                "m.change_password": {"enabled": False},
                "m.set_displayname": {"enabled": True},
                "m.set_avatar_url": {"enabled": True},
                "m.3pid_changes": {"enabled": False},
            }
        }

    async def keys_upload(self, request: ClientRequest) -> dict:
        return {"one_time_key_counts": {}}

    async def keys_query(self, request: ClientRequest) -> dict:
        return {"device_keys": {}, "failures": {}}

    async def nothing(self, request: ClientRequest) -> dict:
        return {}
