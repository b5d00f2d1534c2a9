"""``roomstore homeserver`` against a real Synapse: /sync and /messages
latency and throughput under concurrent clients (issue 41: p99 at most 0.5x
Synapse's).

usage: .venv/bin/python bench/homeserver_latency.py [--engine sqlite|postgres] [--users 20] [--rooms 200]
       [--messages 6] [--rounds 2] [--requests 4] [--wakes 150] [--send-rate 20]

Both servers run at once on this machine, on the same engine (``--engine
postgres`` needs ``ROOMSTORE_BENCH_POSTGRES`` or ``--postgres URL``, an admin
URL: each server gets a fresh database there; ``bench/with-postgres`` starts a
throwaway server): ``roomstore homeserver`` as a subprocess, and Synapse
1.163.2 from ``.venv-synapse`` as ``tests/synapse_server.py`` starts it (rate
limits raised), with its /sync response cache off (``caches.
sync_response_cache_duration: 0``: by default it answers a repeated identical
request from memory for two minutes, which this benchmark's repeated initial
syncs would measure instead of the server). Each gets the same world through
its client API: ``--users`` users, ``--rooms`` rooms each created by one user
with the next two invited and joined (so each user is in about 3 x rooms /
users rooms), ``--messages`` messages a room.

One client code (aiohttp, one session per user, keep-alive, as an app keeps
its connection) makes identical requests of both, in three phases; each phase
takes turns between the servers (``--rounds`` turns each, the first server
alternating), and its samples are pooled per server:

* initial /sync: every user, ``--requests`` times in a closed loop, ``GET
  /sync?timeout=0&filter={"room":{"timeline":{"limit":10}}}``;
* /messages: every user, ``--requests`` times, a random room of theirs, the
  newest 20 events (``dir=b``) and the page before them (``from`` the first
  page's ``end``): two samples;
* incremental /sync: every user long-polls (``timeout=30000``, each sync from
  the last one's ``next_batch``) while ``--wakes`` messages go to random rooms
  (sent by the room's creator, paced at ``--send-rate`` a second); a sample
  is the time from the send's start until a member's long-poll returns with
  the event, for each member of the room (the sender included), and every
  delivery is checked to arrive.

``ROOMSTORE_BENCH_PROFILE=out.txt``: ``roomstore homeserver`` runs under
``py-spy record --threads --format raw`` writing there (stop it with the run).

Prints, per phase, p50 and p99 latency (ms) and throughput (requests, or for
the long-poll deliveries, a second of the phase's wall time) for each server,
and the ratio roomstore / Synapse. A run with ``--messages 10 --requests 10
--wakes 200`` on PostgreSQL took 8 minutes on two shared cores (Synapse: 112 s
to build its world, 150 s of initial syncs); the defaults are cut to about
four.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402  (matrix-nio's dependency, in the test extra)

from bench._common import new_postgres_database, print_table  # noqa: E402
from tests import synapse_server  # noqa: E402

SERVER_NAME = "bench.local"
SYNC_FILTER = json.dumps({"room": {"timeline": {"limit": 10}}}, separators=(",", ":"))
LONG_POLL_MS = 30000


class ApiError(Exception):
    pass


class Client:
    """One user's session with a server: ``call`` returns the JSON answer
    and the seconds it took; anything but 200 raises."""

    def __init__(self, base: str, user_id: str, token: str):
        self.base, self.user_id, self.token = base, user_id, token
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=4),
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=LONG_POLL_MS / 1000 + 60),
        )

    async def call(self, method: str, path: str, body=None, query: dict | None = None) -> tuple[dict, float]:
        url = self.base + "/_matrix/client/v3" + path
        started = time.perf_counter()
        async with self.session.request(method, url, json=body, params=query) as response:
            data = await response.read()
        seconds = time.perf_counter() - started
        if response.status != 200:
            raise ApiError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data), seconds

    async def close(self) -> None:
        await self.session.close()


def room_path(room_id: str) -> str:
    return "/rooms/" + urllib.parse.quote(room_id, safe="")


# ---------------------------------------------------------------- the servers


class Roomstore:
    name = "roomstore"

    def __init__(self, db_url: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        profile = os.environ.get("ROOMSTORE_BENCH_PROFILE")
        # py-spy records the server's threads for the whole run (raw, flamegraph-collapsed stacks).
        spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--threads", "-r", "200", "--format", "raw"]
        self.proc = subprocess.Popen(
            [
                *((*spy, "-o", profile, "--") if profile else ()),
                sys.executable,
                "-m",
                "roomstore.cli",
                "homeserver",
                "--db",
                db_url,
                "--server-name",
                SERVER_NAME,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # py-spy's own lines come first
            line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"roomstore homeserver exited {self.proc.wait()}")
        self.base = f"http://127.0.0.1:{json.loads(line)['serving']['port']}"

    async def register(self, localpart: str) -> Client:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                self.base + "/_matrix/client/v3/register",
                json={
                    "username": localpart,
                    "password": "pw-" + localpart,
                    "auth": {"type": "m.login.dummy"},
                },
            ) as response:
                answer = await response.json()
        return Client(self.base, answer["user_id"], answer["access_token"])

    def stop(self) -> None:
        # Under py-spy, the server is its child: stopping it lets py-spy write its profile and exit.
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        pids = [int(p) for p in children.read_text().split()] if children.exists() else []
        for pid in pids or [self.proc.pid]:
            os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Synapse:
    name = "synapse"

    def __init__(self, pg_url: str | None):
        self.folder = synapse_server.start(pg_url, extra_config={"caches": {"sync_response_cache_duration": "0"}})
        self.server = synapse_server.SynapseServer(self.folder)
        self.base = self.server.base_url

    async def register(self, localpart: str) -> Client:
        user = await asyncio.to_thread(self.server.register, localpart)
        return Client(self.base, user.user_id, user.token)

    def stop(self) -> None:
        synapse_server.stop(self.folder)


# ---------------------------------------------------------------- the world


class World:
    """A server's users and rooms: ``members[room]`` (user indexes, the creator first)."""

    def __init__(self, server, clients: list[Client], members: dict[str, list[int]]):
        self.server, self.clients, self.members = server, clients, members
        self.rooms_of: dict[int, list[str]] = {}
        for room, users in members.items():
            for user in users:
                self.rooms_of.setdefault(user, []).append(room)


async def build_world(server, args, rng: random.Random) -> World:
    started = time.monotonic()
    clients = list(await asyncio.gather(*(server.register(f"user{i}") for i in range(args.users))))

    async def rooms_of(creator: int) -> list[tuple[str, list[int]]]:
        made = []
        for _ in range(creator, args.rooms, args.users):
            invitees = [(creator + k) % args.users for k in (1, 2) if (creator + k) % args.users != creator]
            answer, _ = await clients[creator].call(
                "POST", "/createRoom", {"preset": "private_chat", "invite": [clients[i].user_id for i in invitees]}
            )
            made.append((answer["room_id"], [creator, *invitees]))
        return made

    made = [room for rooms in await asyncio.gather(*(rooms_of(i) for i in range(args.users))) for room in rooms]
    members = dict(made)
    joins: dict[int, list[str]] = {}
    for room, users in made:
        for user in users[1:]:
            joins.setdefault(user, []).append(room)

    async def join_all(user: int) -> None:
        for room in joins.get(user, []):
            await clients[user].call("POST", f"{room_path(room)}/join", {})

    await asyncio.gather(*(join_all(user) for user in joins))
    world = World(server, clients, members)

    async def chat(user: int) -> None:
        mine = world.rooms_of[user]
        for n in range(args.messages * len(mine) // 3):
            room = rng.choice(mine)
            await clients[user].call(
                "PUT",
                f"{room_path(room)}/send/m.room.message/w{n}",
                {"msgtype": "m.text", "body": f"message {n} from user {user}"},
            )

    await asyncio.gather(*(chat(user) for user in range(args.users)))
    print(
        f"{server.name}: {args.users} users, {len(members)} rooms, ~{args.messages} messages a room "
        f"in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return world


# ---------------------------------------------------------------- the phases


async def initial_syncs(world: World, args, rng: random.Random) -> tuple[list[float], int, float]:
    """(latencies, requests, wall seconds)."""

    async def one_user(client: Client) -> list[float]:
        return [
            (await client.call("GET", "/sync", query={"timeout": "0", "filter": SYNC_FILTER}))[1]
            for _ in range(args.requests)
        ]

    started = time.perf_counter()
    per_user = await asyncio.gather(*(one_user(c) for c in world.clients))
    samples = [s for user in per_user for s in user]
    return samples, len(samples), time.perf_counter() - started


async def messages_pages(world: World, args, rng: random.Random) -> tuple[list[float], int, float]:
    async def one_user(index: int) -> list[float]:
        client, samples = world.clients[index], []
        for _ in range(args.requests):
            path = f"{room_path(rng.choice(world.rooms_of[index]))}/messages"
            page, first = await client.call("GET", path, query={"dir": "b", "limit": "20"})
            samples.append(first)
            if page.get("end"):
                samples.append(
                    (await client.call("GET", path, query={"dir": "b", "limit": "20", "from": page["end"]}))[1]
                )
        return samples

    started = time.perf_counter()
    per_user = await asyncio.gather(*(one_user(i) for i in range(len(world.clients))))
    samples = [s for user in per_user for s in user]
    return samples, len(samples), time.perf_counter() - started


async def long_polls(world: World, args, rng: random.Random) -> tuple[list[float], int, float]:
    """Wake latencies (send start -> a member's long-poll returns with the event)."""
    sent_at: dict[str, float] = {}
    seen: dict[str, dict[int, float]] = {}
    stop = asyncio.Event()

    async def poller(index: int, since: str) -> None:
        client = world.clients[index]
        while not stop.is_set():
            body, _ = await client.call(
                "GET", "/sync", query={"since": since, "timeout": str(LONG_POLL_MS), "filter": SYNC_FILTER}
            )
            now = time.perf_counter()
            since = body["next_batch"]
            for room in body.get("rooms", {}).get("join", {}).values():
                for event in room.get("timeline", {}).get("events", []):
                    seen.setdefault(event["event_id"], {}).setdefault(index, now)

    starts = await asyncio.gather(
        *(c.call("GET", "/sync", query={"timeout": "0", "filter": SYNC_FILTER}) for c in world.clients)
    )
    pollers = [asyncio.ensure_future(poller(i, body["next_batch"])) for i, (body, _) in enumerate(starts)]
    await asyncio.sleep(0.5)  # every long-poll waiting
    expected: dict[str, list[int]] = {}
    started = time.perf_counter()
    rooms = sorted(world.members)
    for n in range(args.wakes):
        room = rng.choice(rooms)
        creator = world.members[room][0]
        t0 = time.perf_counter()
        answer, _ = await world.clients[creator].call(
            "PUT",
            f"{room_path(room)}/send/m.room.message/wake-{time.monotonic_ns()}-{n}",
            {"msgtype": "m.text", "body": f"wake {n}"},
        )
        sent_at[answer["event_id"]], expected[answer["event_id"]] = t0, world.members[room]
        await asyncio.sleep(max(0.0, t0 + 1 / args.send_rate - time.perf_counter()))
    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline and any(set(users) - set(seen.get(e, {})) for e, users in expected.items()):
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - started
    stop.set()
    for task in pollers:
        task.cancel()
    await asyncio.gather(*pollers, return_exceptions=True)
    missing = sum(len(set(users) - set(seen.get(e, {}))) for e, users in expected.items())
    if missing:
        print(f"{world.server.name}: {missing} deliveries never arrived", flush=True)
    samples = [seen[e][u] - sent_at[e] for e, users in expected.items() for u in users if u in seen.get(e, {})]
    return samples, len(samples), wall


PHASES = [("initial /sync", initial_syncs), ("/messages", messages_pages), ("incremental /sync wake", long_polls)]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(args) -> None:
    rng = random.Random(args.seed)
    pg = args.postgres or os.environ.get("ROOMSTORE_BENCH_POSTGRES")
    if args.engine == "postgres" and not pg:
        raise SystemExit("--engine postgres needs --postgres URL or ROOMSTORE_BENCH_POSTGRES (bench/with-postgres)")
    servers = []
    try:
        servers.append(Roomstore(fresh_db_url(args.engine, pg)))
        servers.append(await asyncio.to_thread(Synapse, pg if args.engine == "postgres" else None))
        worlds = [await build_world(server, args, random.Random(args.seed)) for server in servers]
        results: dict[tuple[str, str], tuple[list[float], int, float]] = {}
        for phase, measure in PHASES:
            for turn in range(args.rounds):
                for world in worlds if turn % 2 == 0 else worlds[::-1]:
                    samples, count, wall = await measure(world, args, rng)
                    old = results.get((phase, world.server.name), ([], 0, 0.0))
                    results[(phase, world.server.name)] = (old[0] + samples, old[1] + count, old[2] + wall)
            print(f"{phase}: done", flush=True)
        report(results, args)
        for world in worlds:
            for client in world.clients:
                await client.close()
    finally:
        for server in servers:
            server.stop()


def fresh_db_url(engine: str, pg: str | None) -> str:
    if engine == "sqlite":
        import tempfile

        return f"sqlite:///{tempfile.mkdtemp(prefix='roomstore-bench-hs-')}/hs.db"
    return new_postgres_database(pg, f"rs_bench_hs_{os.getpid()}")


def report(results, args) -> None:
    rows = []
    for phase, _ in PHASES:
        ours, theirs = results[(phase, "roomstore")], results[(phase, "synapse")]
        for label, q in (("p50 ms", 0.5), ("p99 ms", 0.99)):
            a, b = percentile(ours[0], q) * 1000, percentile(theirs[0], q) * 1000
            rows.append([phase, label, a, b, f"{a / b:.2f}x"])
        unit = "deliveries/s" if phase.startswith("incremental") else "requests/s"
        a, b = ours[1] / ours[2], theirs[1] / theirs[2]
        rows.append([phase, unit, a, b, f"{a / b:.2f}x"])
    print(
        f"\n{args.users} clients, {args.rooms} rooms, {args.engine}, {args.rounds} turns each "
        f"(ratio: roomstore / synapse; goal p99 <= 0.5x)"
    )
    print_table(["phase", "metric", "roomstore", "synapse 1.163.2", "ratio"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres", help="admin URL of a PostgreSQL server (default: ROOMSTORE_BENCH_POSTGRES)")
    parser.add_argument("--users", type=int, default=20, help="concurrent clients (default 20)")
    parser.add_argument("--rooms", type=int, default=200, help="rooms (default 200)")
    parser.add_argument("--messages", type=int, default=6, help="messages a room, about (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="turns each server takes per phase (default 2)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client per turn (default 4)")
    parser.add_argument("--wakes", type=int, default=150, help="messages sent per long-poll turn (default 150)")
    parser.add_argument("--send-rate", type=float, default=20.0, help="their pace, a second (default 20)")
    parser.add_argument("--seed", type=int, default=41)
    args = parser.parse_args()
    if args.users < 3:
        parser.error("--users must be at least 3 (each room has its creator and two invitees)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
