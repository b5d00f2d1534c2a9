"""``roomstore purge-history`` and ``purge-room``: the command line of
``RoomStore.purge_history`` and ``purge_room``. ``roomstore.cli`` registers
them. Each prints what it removed as one
JSON line (``PurgeResult.as_json``)."""

from __future__ import annotations

from roomstore.cli.common import CliError, emit, open_store


def add_parsers(add) -> None:
    """Add the two commands through the command line's ``add(name, help)``."""
    p = add("purge-history", "delete a room's events before a point, keeping what the room still needs")
    p.add_argument("room_id", help="the room whose history to purge")
    p.add_argument(
        "--before",
        required=True,
        metavar="TOKEN",
        help="a t<topo>-<stream> token (the event it follows goes too) or a stream token",
    )
    p.add_argument(
        "--server-name",
        default=None,
        help="this homeserver's name: its users' events are kept (default: none is local)",
    )
    p.add_argument(
        "--delete-local-events",
        action="store_true",
        help="delete the events of --server-name's users too (default: kept as outliers)",
    )
    p = add("purge-room", "delete every row of a room")
    p.add_argument("room_id", help="the room to delete")


def _room_id(text: str) -> str:
    if not text.startswith("!"):
        raise CliError(f"{text!r} is not a room ID (it starts with !)")
    return text


async def cmd_purge_history(reactor, args) -> int:
    from roomstore.events.tokens import InvalidToken

    room_id = _room_id(args.room_id)
    store = await open_store(reactor, args, server_name=args.server_name)
    try:
        try:
            result = await store.purge_history(room_id, args.before, args.delete_local_events)
        except InvalidToken as exc:
            raise CliError(f"--before: {exc}") from None
        emit(result.as_json())
    finally:
        await store.close()
    return 0


async def cmd_purge_room(reactor, args) -> int:
    room_id = _room_id(args.room_id)
    store = await open_store(reactor, args)
    try:
        emit((await store.purge_room(room_id)).as_json())
    finally:
        await store.close()
    return 0
