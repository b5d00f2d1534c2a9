"""The homeserver, composed: the store (with the homeserver's embedder
schema), the server's signing key, and the client API's resource tree.

    hs = await Homeserver.open("sqlite:///var/hs.db", "example.org")
    port = hs.listen(8008, "127.0.0.1")
    ...
    await port.stopListening(); await hs.close()
"""

from __future__ import annotations

import secrets
from pathlib import Path

from signedjson.key import decode_signing_key_base64, encode_signing_key_base64, generate_signing_key
from twisted.web import server

from roomstore.homeserver.admin import ADMIN_PREFIXES, Admin
from roomstore.homeserver.auth import Accounts
from roomstore.homeserver.create_room import RoomCreator
from roomstore.homeserver.events import EventCreator
from roomstore.homeserver.filters import Filters
from roomstore.homeserver.http import ClientResource, Router, site_root
from roomstore.homeserver.membership import Memberships
from roomstore.homeserver.messages import History
from roomstore.homeserver.notifier import Notifier
from roomstore.homeserver.profile import Profiles
from roomstore.homeserver.pushrules import PushRules
from roomstore.homeserver.room_state import RoomState
from roomstore.homeserver.sending import Sending
from roomstore.homeserver.sync import SyncHandler
from roomstore.homeserver.tables.signing_keys import get_or_add_signing_key_txn
from roomstore.homeserver.versions import ServerInfo
from roomstore.storage.embedder_schema import EmbedderSchema
from roomstore.store import RoomStore, StoreConfig

__all__ = ["HOMESERVER_SCHEMA", "Homeserver"]

#: The homeserver's tables (accounts and who is an admin, devices, tokens, profiles, filters, its key),
#: migrated with the store's.
HOMESERVER_SCHEMA = EmbedderSchema("homeserver", Path(__file__).resolve().parent / "schema")


async def _signing_key(store, server_name: str):
    """The server's key from the database; made and stored at the first start."""
    fresh = generate_signing_key("a_" + secrets.token_hex(2))
    key_id, key_base64 = await store.db.run_interaction(
        "hs_signing_key",
        get_or_add_signing_key_txn,
        server_name,
        f"ed25519:{fresh.version}",
        encode_signing_key_base64(fresh),
    )
    return decode_signing_key_base64("ed25519", key_id.partition(":")[2], key_base64)


class Homeserver:
    """A single-server Matrix homeserver on a ``RoomStore``."""

    def __init__(self, store, server_name: str, signing_key, reactor, registration_open: bool):
        self.store = store
        self.server_name = server_name
        self.notifier = Notifier(reactor)
        store.add_invalidation_hook(self.notifier.notify)
        self.events = EventCreator(store, server_name, signing_key, reactor)
        profiles = Profiles(store.db, self.events)
        self.accounts = Accounts(
            store.db,
            server_name,
            reactor,
            registration_open,
            on_register=lambda user, name: profiles.set_field(user, "displayname", name),
        )
        filters = Filters(store.db)
        router = Router()
        for part in (
            self.accounts,
            profiles,
            filters,
            ServerInfo(),
            PushRules(),
            RoomCreator(self.events, profiles.profile_of),
            Memberships(self.events, profiles.profile_of),
            RoomState(self.events),
            Sending(self.events),
            History(store),
            SyncHandler(store, filters, self.notifier, reactor),
        ):
            part.register_routes(router)
        admin_router = Router()
        Admin(store, self.accounts).register_routes(admin_router)
        self.resource = site_root(
            ClientResource(router, self.accounts.authenticate),
            ClientResource(admin_router, self.accounts.authenticate, ADMIN_PREFIXES),
        )

    @classmethod
    async def open(
        cls,
        db_url: str,
        server_name: str,
        *,
        registration_open: bool = True,
        reactor=None,
        instance_name: str = "master",
    ) -> Homeserver:
        if reactor is None:
            from twisted.internet import reactor
        config = StoreConfig(instance_name=instance_name, server_name=server_name, embedder_schemas=[HOMESERVER_SCHEMA])
        store = await RoomStore.open(db_url, config, reactor=reactor)
        try:
            key = await _signing_key(store, server_name)
        except BaseException:
            await store.close()
            raise
        return cls(store, server_name, key, reactor, registration_open)

    def site(self) -> server.Site:
        site = server.Site(self.resource)
        site.displayTracebacks = False
        return site

    def listen(self, port: int, bind: str = "127.0.0.1", reactor=None):
        """Start serving; the listening port (``getHost().port`` when 0 was asked)."""
        if reactor is None:
            from twisted.internet import reactor
        return reactor.listenTCP(port, self.site(), interface=bind)

    async def close(self) -> None:
        await self.store.close()
