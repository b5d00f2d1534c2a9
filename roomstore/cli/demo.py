"""``roomstore demo`` and ``generate-sample``: the main job on the bundled
sample (import it, then show each kind of read) and writing a generated
sample history of any size."""

from __future__ import annotations

import os

from roomstore.cli.common import emit, open_store
from roomstore.cli.import_loop import import_file
from roomstore.cli.reads import state_as_json
from roomstore.cli.schema import report_positions

SAMPLE_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "sample-rooms.jsonl")


def add_parsers(add) -> None:
    """Add the two commands through the command line's ``add(name, help)``."""
    p = add("demo", "the main job: import the bundled sample and show the reads")
    p.add_argument(
        "--sample", default=SAMPLE_PATH, help="the JSON-lines history to import (default: the bundled sample)"
    )
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p = add("generate-sample", "write a generated sample history (JSON lines)")
    p.add_argument("output", help="the JSON-lines file to write")
    p.add_argument("--rooms", type=int, default=5, help="rooms to generate (default 5)")
    p.add_argument("--events-per-room", type=int, default=800, help="events per room, about (default 800)")
    p.add_argument("--seed", type=int, default=7, help="random seed: the same seed writes the same file (default 7)")


async def cmd_demo(reactor, args) -> int:
    """The main job on the embedded default: import the bundled sample and
    show each kind of read."""
    store = await open_store(reactor, args, create=True)
    try:
        await report_positions(store)
        summary = await import_file(store, args.sample, progress=args.progress)
        emit({"import": args.sample, **summary})
        room_id = (await store.get_room_ids())[0]
        create_id = (await store.get_current_state_ids(room_id, [("m.room.create", "")]))[("m.room.create", "")]
        creator = (await store.get_event(create_id))["sender"]
        emit(
            {
                "demo": "current state",
                "room_id": room_id,
                "room_version": await store.get_room_version(room_id),
                "state": state_as_json(
                    await store.get_current_state_ids(
                        room_id, [("m.room.topic", ""), ("m.room.history_visibility", "")]
                    )
                ),
            }
        )
        extremities = await store.get_forward_extremities(room_id)
        state = await store.get_state_ids(extremities[0], before=True)
        emit({"demo": "state before a forward extremity", "event_id": extremities[0], "entries": len(state)})
        users = await store.get_users_in_room(room_id)
        emit({"demo": "users in room", "room_id": room_id, "joined": len(users)})
        page = await store.paginate(room_id, creator, None, "b", 5)
        emit(
            {
                "demo": "messages (newest 5)",
                "user": creator,
                "events": [(e["event_id"], e["type"]) for e in page.events],
                "next_token": page.next_token,
            }
        )
        recent = await store.recent(creator, 3, 2, None)
        emit(
            {
                "demo": "recent (2 events in 3 rooms)",
                "user": creator,
                "rooms": [(r, [e["event_id"] for e in evs]) for r, evs in recent.rooms],
            }
        )
        sync = await store.sync(creator, "s0")
        emit(
            {
                "demo": "sync since s0",
                "user": creator,
                "rooms": {r: len(evs) for r, evs in sync.rooms.items()},
                "membership_changes": len(sync.membership_events),
                "next_token": sync.next_token,
            }
        )
        for row in await store.table_stats():
            if row["table"] in ("events", "state_group_deltas", "visibility_memberships", "redactions"):
                emit({"demo": "stats", **row})
    finally:
        await store.close()
    return 0


async def cmd_generate_sample(reactor, args) -> int:
    from roomstore.demo.sample import write_sample

    count = write_sample(args.output, rooms=args.rooms, events_per_room=args.events_per_room, seed=args.seed)
    emit({"written": args.output, "events": count})
    return 0
