"""Two matrix-nio clients that keep syncing and sending while the test
purges their room (``test_admin.py``): ``python nio_live.py BASE_URL``.

Registers alice and bob, alice makes a room and invites bob, bob joins,
alice sends ``MESSAGES`` messages; prints ``{"ready": ...}`` (the room, the
users and their access tokens). Then both long-poll ``/sync`` and send in
turns until a line ``check`` comes on standard input; then alice sends one
more message, which bob's long-poll must bring within seconds, and bob pages
back from his last sync's ``prev_batch`` to the room's start (it must end
without an error). Prints ``{"done": ...}`` with what it saw; any failed
request ends it with exit 1 and an ``{"error": ...}`` line."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nio import (
    AsyncClient,
    MessageDirection,
    RoomMessagesResponse,
    RoomSendResponse,
    SyncResponse,
)

MESSAGES = 30


class Failed(Exception):
    pass


def say(**facts) -> None:
    print(json.dumps(facts), flush=True)


async def user(base: str, name: str) -> AsyncClient:
    client = AsyncClient(base, name)
    response = await client.register(name, "a password", device_name=f"{name}'s nio")
    if not getattr(response, "access_token", None):
        raise Failed(f"register {name}: {response}")
    return client


async def send(client: AsyncClient, room: str, body: str) -> str:
    response = await client.room_send(room, "m.room.message", {"msgtype": "m.text", "body": body})
    if not isinstance(response, RoomSendResponse):
        raise Failed(f"send {body}: {response}")
    return response.event_id


async def keep_busy(client: AsyncClient, room: str, stop: asyncio.Event, counts: dict) -> None:
    """Long-poll and send in turns until ``stop``."""
    while not stop.is_set():
        synced = await client.sync(timeout=500)
        if not isinstance(synced, SyncResponse):
            raise Failed(f"{client.user}: sync: {synced}")
        counts["syncs"] += 1
        await send(client, room, f"{client.user} live {counts['sent']}")
        counts["sent"] += 1


async def wait_for(client: AsyncClient, room: str, event_id: str, seconds: float) -> float:
    """Long-poll until ``event_id`` arrives; how long it took."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        synced = await client.sync(timeout=int(seconds * 1000))
        if not isinstance(synced, SyncResponse):
            raise Failed(f"sync: {synced}")
        joined = synced.rooms.join.get(room)
        if joined is not None and any(e.event_id == event_id for e in joined.timeline.events):
            return time.monotonic() - started
    raise Failed(f"{event_id} did not reach the other's long-poll in {seconds} s")


async def page_back(client: AsyncClient, room: str, start: str) -> list[str]:
    ids, token = [], start
    while token:
        page = await client.room_messages(room, start=token, direction=MessageDirection.back, limit=20)
        if not isinstance(page, RoomMessagesResponse):
            raise Failed(f"messages from {token}: {page}")
        ids += [e.event_id for e in page.chunk]
        token = page.end if page.chunk else None
    return ids


async def main(base: str) -> None:
    alice, bob = await user(base, "alice"), await user(base, "bob")
    try:
        created = await alice.room_create(name="Purged", invite=[bob.user_id])
        room = created.room_id
        await bob.join(room)
        for i in range(MESSAGES):
            await send(alice, room, f"before {i}")
        await alice.sync(timeout=0)
        await bob.sync(timeout=0)
        say(
            ready={
                "room_id": room,
                "alice": [alice.user_id, alice.access_token],
                "bob": [bob.user_id, bob.access_token],
            }
        )
        stop = asyncio.Event()
        counts = {"alice": {"syncs": 0, "sent": 0}, "bob": {"syncs": 0, "sent": 0}}
        busy = [
            asyncio.ensure_future(keep_busy(alice, room, stop, counts["alice"])),
            asyncio.ensure_future(keep_busy(bob, room, stop, counts["bob"])),
        ]
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        stop.set()
        await asyncio.gather(*busy)
        if line.strip() != "check":
            raise Failed(f"expected 'check', got {line!r}")
        last = await send(alice, room, "after the purge")
        took = await wait_for(bob, room, last, 10)
        fresh = await bob.sync(timeout=0, full_state=True, sync_filter={"room": {"timeline": {"limit": 5}}})
        if not isinstance(fresh, SyncResponse) or room not in fresh.rooms.join:
            raise Failed(f"bob's initial sync lost the room: {fresh}")
        timeline = fresh.rooms.join[room].timeline
        older = await page_back(bob, room, timeline.prev_batch)
        say(done={"counts": counts, "woken_s": round(took, 3), "last": last, "paged_back": older})
    finally:
        await alice.close()
        await bob.close()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1]))
    except Failed as exc:
        say(error=str(exc))
        sys.exit(1)
