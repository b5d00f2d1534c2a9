"""The read commands (``state``, ``messages``, ``sync``, ``recent``,
``stats``): each opens the store read-only, so it runs beside a live
writer, and prints what one read of ``RoomStore`` returns."""

from __future__ import annotations

from roomstore.cli.common import CliError, emit, open_store


def add_parsers(add) -> None:
    """Add the read commands through the command line's ``add(name, help)``."""
    p = add("state", "the state at an event")
    p.add_argument("event_id", help="the event whose state to show")
    p.add_argument("--before", action="store_true", help="the state before the event, not after")
    p = add("messages", "a page of a room's timeline as a user sees it")
    p.add_argument("room_id", help="the room to page through")
    p.add_argument("--user", required=True, help="the user the page is shown to (history visibility applies)")
    p.add_argument(
        "--from",
        dest="from_token",
        default=None,
        help="a t<topo>-<stream> or stream token to start from (default: the newest end for b, the start for f)",
    )
    p.add_argument("--dir", choices=["b", "f"], default="b", help="b: backwards, newest first (default); f: forwards")
    p.add_argument("--limit", type=int, default=10, help="events per page (default 10)")
    p = add("sync", "new events for a user since a token; without --since an initial sync")
    p.add_argument("--user", required=True, help="the syncing user")
    p.add_argument(
        "--since",
        default=None,
        help="a next_token from an earlier sync (default: an initial sync, the newest events of each room)",
    )
    p.add_argument("--limit", type=int, default=10, help="events per room on an initial sync (default 10)")
    p = add("recent", "the newest events in a user's most recently active rooms")
    p.add_argument("--user", required=True, help="the user whose joined rooms to show")
    p.add_argument("--rooms", type=int, default=5, help="how many of the most recently active rooms (default 5)")
    p.add_argument("--events", type=int, default=10, help="newest events per room (default 10)")
    p.add_argument("--cursor", default=None, help="a next_cursor from an earlier page, for the next rooms")
    add("stats", "rows and bytes per table")


def state_as_json(state: dict) -> list[dict]:
    return [{"type": t, "state_key": k, "event_id": e} for (t, k), e in sorted(state.items())]


async def cmd_state(reactor, args) -> int:
    from roomstore.storage.errors import NotFoundError

    store = await open_store(reactor, args, read_only=True)
    try:
        try:
            state = await store.get_state_ids(args.event_id, before=args.before)
        except NotFoundError as exc:  # not stored, or an outlier (no state)
            raise CliError(str(exc)) from None
        emit({"event_id": args.event_id, "before": args.before, "state": state_as_json(state)})
    finally:
        await store.close()
    return 0


async def cmd_messages(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        if await store.get_room_version(args.room_id) is None:
            raise CliError(f"unknown room {args.room_id}: no create event of it is stored")
        page = await store.paginate(args.room_id, args.user, args.from_token, args.dir, args.limit)
        for event in page.events:
            emit(event)
        emit({"next_token": page.next_token})
    finally:
        await store.close()
    return 0


async def cmd_sync(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        result = await store.sync(args.user, args.since, args.limit)
        for room_id, events in sorted(result.rooms.items()):
            for event in events:
                emit({"room_id": room_id, "event": event})
        for event in result.membership_events:
            emit({"membership_change": event})
        emit({"next_token": result.next_token})
    finally:
        await store.close()
    return 0


async def cmd_recent(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        result = await store.recent(args.user, args.rooms, args.events, args.cursor)
        for room_id, events in result.rooms:
            emit({"room_id": room_id, "events": events})
        emit({"next_cursor": result.next_cursor})
    finally:
        await store.close()
    return 0


async def cmd_stats(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        for row in await store.table_stats():
            emit(row)
    finally:
        await store.close()
    return 0
