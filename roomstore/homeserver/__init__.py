"""A single-server Matrix homeserver (no federation) on ``RoomStore``'s public
face, as any embedder would write it: the client-server API's subset that
clients need to log in and chat (``roomstore homeserver``; README, "Run a
homeserver").

One concern per module: ``http`` (routing, error JSON), ``auth`` (accounts,
devices, tokens; ``passwords``), ``events`` (building and storing the
server's events), ``create_room``, ``membership``, ``room_state``,
``sending``, ``sync`` (with ``notifier``), ``messages``, ``filters``,
``pushrules``, ``profile``, ``versions``, ``admin`` (the admin API's
purges, for server admins); ``tables/`` holds the SQL of the
homeserver's own tables, created by the embedder schema in ``schema/``;
``server`` composes them.
"""

from roomstore.homeserver.server import HOMESERVER_SCHEMA, Homeserver

__all__ = ["HOMESERVER_SCHEMA", "Homeserver"]
