"""The issue 41 scenario driven by matrix-nio, a real Matrix client, against
a running ``roomstore homeserver``: ``python nio_scenario.py BASE_URL
SERVER_NAME``. Prints one JSON line per step; exits 1 on the first step that
fails (its line says why). Run by ``test_clients.py``."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nio import AsyncClient, MessageDirection, RoomMessagesResponse, SyncResponse


class StepFailed(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise StepFailed(what)


def step(name: str, **facts) -> None:
    print(json.dumps({"step": name, **facts}), flush=True)


async def user(base: str, name: str) -> AsyncClient:
    client = AsyncClient(base, name)
    response = await client.register(name, "a password", device_name=f"{name}'s nio")
    check(bool(getattr(response, "access_token", None)), f"register {name}: {response}")
    return client


async def all_messages_back(client: AsyncClient, room: str, start: str) -> list[str]:
    """Every m.room.message event ID from ``start`` back to the room's start, newest first."""
    ids, token = [], start
    while token:
        page = await client.room_messages(room, start=token, direction=MessageDirection.back, limit=30)
        check(isinstance(page, RoomMessagesResponse), f"messages: {page}")
        ids += [e.event_id for e in page.chunk if e.source.get("type") == "m.room.message"]
        token = page.end if page.chunk else None
    return ids


async def scenario(base: str, server_name: str) -> None:
    alice, bob = await user(base, "alice"), await user(base, "bob")
    try:
        created = await alice.room_create(name="Tea", topic="leaves", invite=[f"@bob:{server_name}"])
        room = created.room_id
        step("createRoom", room_id=room)
        first = await bob.sync(timeout=0, full_state=True)
        check(isinstance(first, SyncResponse) and room in first.rooms.invite, f"no invite in bob's sync: {first}")
        step("invite seen in initial sync")
        joined = await bob.join(room)
        check(getattr(joined, "room_id", None) == room, f"join: {joined}")
        sent = []
        for i in range(100):
            response = await alice.room_send(
                room, "m.room.message", {"msgtype": "m.text", "body": f"m{i}"}, tx_id=f"txn-{i}"
            )
            sent.append(response.event_id)
        retried = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "again"}, tx_id="txn-7")
        check(retried.event_id == sent[7], "a retried txnId made a new event")
        step("100 messages sent; a retried txnId returned the same event")
        redaction = await alice.room_redact(room, sent[50], reason="typo", tx_id="redact-1")
        check(bool(getattr(redaction, "event_id", None)), f"redact: {redaction}")
        step("redaction")

        limited = await bob.sync(timeout=0, sync_filter={"room": {"timeline": {"limit": 10}}})
        timeline = limited.rooms.join[room].timeline
        check(timeline.limited and bool(timeline.prev_batch), "the sync is not limited or has no prev_batch")
        newest = [e.event_id for e in timeline.events if e.source.get("type") == "m.room.message"]
        older = await all_messages_back(bob, room, timeline.prev_batch)
        check(newest[::-1] + older == sent[::-1], "not every message, newest first")
        step("limited sync and back-pagination", messages=len(newest) + len(older))

        since = limited.next_batch
        waiting = asyncio.ensure_future(bob.sync(timeout=30000, since=since))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        late = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "late"}, tx_id="late")
        woken = await waiting
        elapsed = time.monotonic() - started
        check(elapsed < 1.0, f"the incremental sync took {elapsed:.2f} s after the send")
        check(late.event_id in [e.event_id for e in woken.rooms.join[room].timeline.events], "no late event")
        step("incremental sync woken by a send", seconds=round(elapsed, 3))

        state = await bob.room_get_state(room)
        names = [e for e in state.events if e["type"] == "m.room.name"]
        check(names and names[0]["content"] == {"name": "Tea"}, f"/state: {names}")
        topic = await bob.room_get_state_event(room, "m.room.topic")
        check(topic.content == {"topic": "leaves"}, f"/state/m.room.topic: {topic}")
        step("/state")

        await bob.room_leave(room)
        after = await alice.room_send(
            room, "m.room.message", {"msgtype": "m.text", "body": "bob is gone"}, tx_id="after-leave"
        )
        left = await bob.sync(timeout=0, since=woken.next_batch)
        check(room in left.rooms.leave and room not in left.rooms.join, "the leave is not in bob's sync")
        page = await bob.room_messages(room, start=left.next_batch, direction=MessageDirection.back, limit=20)
        check(after.event_id not in [e.event_id for e in page.chunk], "bob sees a message sent after he left")
        check(late.event_id in [e.event_id for e in page.chunk], "bob lost what he saw before he left")
        step("leave, and what the leaver sees")
    finally:
        await alice.close()
        await bob.close()


def main() -> None:
    try:
        asyncio.run(scenario(sys.argv[1], sys.argv[2]))
    except StepFailed as exc:
        print(json.dumps({"failed": str(exc)}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
