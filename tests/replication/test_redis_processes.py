"""End to end over Redis with real processes, on PostgreSQL.

Two writer instances (``w1``, ``w2``) run ``roomstore import --redis`` one
chunk after another, both into the same rooms at once (each writer extends
its own chain of messages in every room); two followers run ``roomstore
follow --redis -v``. Writers and followers are each SIGKILLed at random
moments and restarted ``KILLS`` times, and the Redis server is killed and
restarted ``REDIS_RESTARTS`` times, all while writes go on.

Checked, per follower, from what its runs printed (stdout) and logged
(stderr, ``-v``):

- every row of every writer, per writer in token order, with no gap, each
  token applied once (a restart may apply again the tokens applied after the
  positions file's last finished write: it is saved off the reactor, one
  write at a time, so the tokens of the write in flight when the kill came;
  how many is counted and printed, never a skip);
- as it runs: every ``linear=L`` the follower logged after applying a token
  or moving a position is such that every event row at or below ``L`` (in
  the database at the end) had been applied by this follower before that
  line, or was at or below its writer's position when the follower's store
  started that run (positions the writers persisted, so complete).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from twisted.internet import defer
from twisted.logger import Logger
from twisted.trial import unittest

from roomstore.replication.store_streams import STORE_STREAMS, store_stream_registry
from roomstore.store import RoomStore, StoreConfig
from tests.db import DatabaseTestMixin

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder

from .redis_utils import RedisServer
from .store_utils import ALICE, BOB, reap, sleep, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLS = int(os.environ.get("ROOMSTORE_E2E_KILLS", "20"))
REDIS_RESTARTS = int(os.environ.get("ROOMSTORE_E2E_REDIS_RESTARTS", "5"))
WRITERS = ("w1", "w2")
FOLLOWERS = ("f1", "f2")
ROOMS = 3
CHUNK_EVENTS = 30
CHANNEL = "e2e.example"

WRITER_ARGS = [arg for name in STORE_STREAMS for arg in ("--stream-writers", f"{name}={','.join(WRITERS)}")]
_LOG_LINE = re.compile(r"(applied|position) (\w+) (\w+) (\d+) .*?linear=(\d+)")
_START_LINE = re.compile(r"store events positions (\{.*\})")


def write_chunks(directory: str, chunks: int) -> tuple[str, dict[str, list[str]]]:
    """The base file (rooms, joins) and per writer its chunk files: in each
    room, each writer extends a chain of its own from the base."""
    rooms = [UncheckedRoomBuilder(f"!e2e{i}:example.org") for i in range(ROOMS)]
    base = os.path.join(directory, "base.jsonl")
    tips: dict[tuple[str, str], str] = {}
    with open(base, "w") as out:
        for room in rooms:
            for built in (room.create(), room.join(ALICE), room.join(BOB)):
                out.write(json.dumps({"room_version": room.version, "event": built.event}) + "\n")
            for writer in WRITERS:
                tips[(writer, room.room_id)] = room.leaves[-1]
    files: dict[str, list[str]] = {w: [] for w in WRITERS}
    for writer in WRITERS:
        for chunk in range(chunks):
            path = os.path.join(directory, f"{writer}-{chunk}.jsonl")
            with open(path, "w") as out:
                for n in range(CHUNK_EVENTS):
                    room = rooms[n % ROOMS]
                    built = room.message(
                        ALICE if n % 2 else BOB,
                        f"{writer} {chunk} {n}",
                        prev=[tips[(writer, room.room_id)]],
                        set_leaves=False,
                    )
                    tips[(writer, room.room_id)] = built.event_id
                    out.write(json.dumps({"room_version": room.version, "event": built.event}) + "\n")
            files[writer].append(path)
    return base, files


class RedisProcessesTest(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"
    timeout = 1800

    async def test_two_writers_two_followers_kills_and_redis_restarts(self):
        seed = int(os.environ.get("ROOMSTORE_KILL_SEED", random.randrange(1 << 30)))
        rng = random.Random(seed)
        self.addCleanup(lambda: print(f"redis e2e seed {seed} (ROOMSTORE_KILL_SEED)"))
        url = self.new_database_url()
        redis = RedisServer(self)
        redis.start()
        directory = tempfile.mkdtemp(prefix="roomstore-e2e-")
        # Spare chunks: an import that ends before its kill moment moves on to
        # the next chunk, and a quiet machine imports fast (see writer_loop).
        base, chunk_files = write_chunks(directory, chunks=4 * KILLS + 6)
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        processes: list[subprocess.Popen] = []

        self.addCleanup(reap, processes)

        def spawn(argv: list[str], out_path: str) -> subprocess.Popen:
            with open(out_path, "wb") as stdout, open(out_path + ".err", "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "roomstore.cli", *argv], stdout=stdout, stderr=stderr, env=env
                )
            processes.append(proc)
            return proc

        def import_argv(writer: str, path: str) -> list[str]:
            return [
                "import",
                path,
                "--db",
                url,
                "--redis",
                redis.url,
                "--server-name",
                CHANNEL,
                "--instance",
                writer,
                "--batch-size",
                "5",
                *WRITER_ARGS,
            ]

        # The rooms exist before anyone follows.
        base_started = time.monotonic()
        proc = spawn(import_argv("w1", base), os.path.join(directory, "base.out"))
        await wait_until(lambda: proc.poll() is not None, 60, "the base import")
        base_seconds = time.monotonic() - base_started
        self.assertEqual(proc.returncode, 0, open(os.path.join(directory, "base.out.err")).read())

        # --- followers: killed and restarted KILLS times each, at random moments
        runs: dict[str, list[str]] = {f: [] for f in FOLLOWERS}
        follower_procs: dict[str, subprocess.Popen] = {}

        def start_follower(name: str) -> None:
            out = os.path.join(directory, f"{name}-run{len(runs[name])}.out")
            runs[name].append(out)
            follower_procs[name] = spawn(
                [
                    "follow",
                    "--db",
                    url,
                    "--redis",
                    redis.url,
                    "--server-name",
                    CHANNEL,
                    "--name",
                    name,
                    "-v",
                    "--positions-file",
                    os.path.join(directory, f"{name}.positions"),
                    *WRITER_ARGS,
                ],
                out,
            )

        # Each follower resumes from its positions file on every start,
        # also when a kill came before it saved one: it starts where the
        # database stands after the base import.
        from roomstore.replication.process_services import save_positions

        reader = await RoomStore.open(
            url,
            StoreConfig(
                instance_name="checker", read_only=True, stream_writers={n: list(WRITERS) for n in STORE_STREAMS}
            ),
        )
        start_positions = {
            (n, w): reader.generators[n].get_current_token_for_writer(w) for n in STORE_STREAMS for w in WRITERS
        }
        await reader.close()
        for name in FOLLOWERS:
            save_positions(os.path.join(directory, f"{name}.positions"), start_positions)
            start_follower(name)

        writers_done = [False]
        chaos_left = [2]  # the follower killer and the Redis restarter, until each has done its count
        stats = {"writer_kills": 0, "follower_kills": 0, "redis_restarts": 0, "lock_refusals": 0}

        async def writer_loop(writer: str) -> None:
            kills = 0
            # The kill moment is a random fraction of the quickest import run
            # to its end so far, so a fast machine is killed mid-import as
            # often as a slow one (fixed delays ran the chunks out there).
            quickest = max(base_seconds, 0.5)
            for index, path in enumerate(chunk_files[writer]):
                if kills >= KILLS and index >= KILLS + 6 and chaos_left[0] == 0:
                    break  # enough writing after the last kill, and under every other kill
                if kills >= KILLS and chaos_left[0]:
                    await sleep(0.5)  # keep writing, slower, while followers and Redis are still being cut
                while True:
                    out = os.path.join(directory, f"{writer}-{index}-{int(time.monotonic() * 1000)}.out")
                    started = time.monotonic()
                    proc = spawn(import_argv(writer, path), out)
                    if kills < KILLS:
                        await sleep(rng.uniform(0.3, 0.9) * quickest)
                        if proc.poll() is None:
                            proc.send_signal(signal.SIGKILL)
                            proc.wait()
                            kills += 1
                            stats["writer_kills"] += 1
                            continue  # the same chunk again: what was imported is skipped
                    await wait_until(lambda: proc.poll() is not None, 120, f"{writer} import")
                    if proc.returncode == 2 and "already running" in open(out + ".err").read():
                        # The killed run's session lock had not been dropped yet.
                        stats["lock_refusals"] += 1
                        await sleep(0.2)
                        continue
                    self.assertEqual(proc.returncode, 0, open(out + ".err").read()[-3000:])
                    quickest = min(quickest, time.monotonic() - started)
                    break
            self.assertEqual(kills, KILLS, f"{writer}: chunks ran out before {KILLS} kills")

        async def follower_killer() -> None:
            kills = {f: 0 for f in FOLLOWERS}
            while not writers_done[0] and any(k < KILLS for k in kills.values()):
                await sleep(rng.uniform(0.5, 2.5))
                name = rng.choice([f for f in FOLLOWERS if kills[f] < KILLS] or list(FOLLOWERS))
                if kills[name] >= KILLS:
                    continue
                proc = follower_procs[name]
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills[name] += 1
                stats["follower_kills"] += 1
                start_follower(name)
            chaos_left[0] -= 1
            self.assertEqual(min(kills.values()), KILLS, "writes ended before every follower was killed enough")

        async def redis_restarter() -> None:
            while stats["redis_restarts"] < REDIS_RESTARTS and not writers_done[0]:
                await sleep(rng.uniform(3.0, 8.0))
                redis.stop()
                await sleep(rng.uniform(0.1, 1.0))
                redis.start()
                stats["redis_restarts"] += 1
            chaos_left[0] -= 1
            self.assertEqual(stats["redis_restarts"], REDIS_RESTARTS, "writes ended before Redis restarts")

        started = time.monotonic()
        writing = defer.gatherResults([defer.ensureDeferred(writer_loop(w)) for w in WRITERS], consumeErrors=True)
        chaos = defer.gatherResults(
            [defer.ensureDeferred(follower_killer()), defer.ensureDeferred(redis_restarter())], consumeErrors=True
        )
        try:
            await writing
        finally:
            writers_done[0] = True
        await chaos

        # The end: every follower catches up with both writers, then stops cleanly.
        store = await RoomStore.open(
            url,
            StoreConfig(
                instance_name="checker", read_only=True, stream_writers={n: list(WRITERS) for n in STORE_STREAMS}
            ),
        )
        self.addCleanup(store.close)
        final = {(n, w): store.generators[n].get_current_token_for_writer(w) for n in STORE_STREAMS for w in WRITERS}
        registry = store_stream_registry(store)
        expected: dict[tuple[str, str], dict[int, list]] = {}
        for (name, writer), upto in final.items():
            rows: dict[int, list] = {}
            for token, row in (await registry.get(name).get_updates(writer, 0, upto, 10**9)).updates:
                rows.setdefault(token, []).append(json.loads(json.dumps(row)))
            expected[(name, writer)] = rows

        def caught_up(name: str) -> bool:
            from roomstore.replication.process_services import load_positions

            saved = load_positions(os.path.join(directory, f"{name}.positions")) or {}
            return all(saved.get((n, w), -1) >= max(expected[(n, w)] or [0]) for n, w in final)

        for name in FOLLOWERS:
            await wait_until(lambda: caught_up(name), 120, f"{name} to catch up")
            # Its positions file may be at the end already while the run the
            # last kill started is still starting: a SIGTERM before its reactor
            # runs kills it outright (-15). Wait until it is connected.
            last_err = runs[name][-1] + ".err"
            await wait_until(
                lambda: "redis replication: connected to" in open(last_err).read(), 60, f"{name}'s last run to connect"
            )
            proc = follower_procs[name]
            proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: proc.poll() is not None, 30, f"{name} to exit")
            self.assertEqual(proc.returncode, 0, open(runs[name][-1] + ".err").read()[-2000:])

        all_events = sorted(t for w in WRITERS for t in expected[("events", w)])
        summary = {}
        for name in FOLLOWERS:
            summary[name] = check_follower(self, name, runs[name], expected, all_events)
        elapsed = time.monotonic() - started
        report = (
            f"redis e2e: {elapsed:.0f}s, seed {seed}, {stats}, events rows per writer "
            f"{ {w: sum(len(r) for r in expected[('events', w)].values()) for w in WRITERS} }, "
            + "; ".join(f"{n}: {s}" for n, s in summary.items())
        )
        print("\n" + report)
        Logger().info("{report}", report=report)  # trial's test.log keeps it under -j
        if os.environ.get("ROOMSTORE_E2E_REPORT"):
            with open(os.environ["ROOMSTORE_E2E_REPORT"], "a") as handle:
                handle.write(report + "\n")


def parse_run(path: str) -> dict:
    """A follower run: its resume positions, applied tokens per (stream,
    writer) with rows, in print order (a last line cut by a kill dropped),
    and its -v log: the store's linear events position at start and every
    (kind, stream, writer, token, linear) line."""
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")[:-1]
    resume = None
    groups: dict[tuple[str, str], list[tuple[int, list]]] = {}
    for line in lines:
        obj = json.loads(line)
        if "following" in obj:
            resume = {(s, w): t for s, tokens in obj["resume"].items() for w, t in tokens.items()}
            continue
        key = (obj["stream"], obj["instance"])
        seq = groups.setdefault(key, [])
        if seq and seq[-1][0] == obj["token"]:
            seq[-1][1].append(obj["row"])
        else:
            seq.append((obj["token"], [obj["row"]]))
    start_linear = None
    log = []
    with open(path + ".err", "rb") as handle:
        for raw in handle.read().decode("utf-8", "replace").splitlines():
            if start_linear is None and (m := _START_LINE.search(raw)):
                start_linear = json.loads(m.group(1))
            if m := _LOG_LINE.search(raw):
                log.append((m.group(1), m.group(2), m.group(3), int(m.group(4)), int(m.group(5))))
    return {"path": path, "resume": resume, "groups": groups, "start_linear": start_linear, "log": log}


def check_follower(test: unittest.TestCase, name: str, paths: list[str], expected: dict, all_events: list[int]) -> dict:
    runs = [parse_run(p) for p in paths]
    first = next(r for r in runs if r["resume"] is not None)
    reapplied = cut = most_again = 0
    last_applied = dict(first["resume"])
    union: dict[tuple[str, str], list[int]] = {key: [] for key in expected}
    applied_events: set[int] = set()
    linear_checks = 0
    for index, run in enumerate(runs):
        context = f"{name} run {index} ({run['path']})"
        if run["resume"] is None:
            test.assertFalse(run["groups"], context)
            continue
        for key, rows in expected.items():
            order = sorted(t for t in rows if t > first["resume"].get(key, 0))
            resume = run["resume"].get(key, 0)
            before = last_applied.get(key, 0)
            test.assertEqual([t for t in order if before < t <= resume], [], f"{context} {key}: skips rows")
            # Applied again: what came after the positions file's last finished write (none skipped, above).
            most_again = max(most_again, len([t for t in order if resume < t <= before]))
            seq = run["groups"].get(key, [])
            if seq and seq[-1][1] != rows.get(seq[-1][0]):
                token, got = seq.pop()  # cut by the kill while printing
                test.assertEqual(got, rows[token][: len(got)], context)
                cut += 1
            previous = resume
            for token, got in seq:
                following = [t for t in order if t > previous]
                test.assertTrue(following, f"{context} {key}: {token} after the last row")
                test.assertEqual(token, following[0], f"{context} {key}: gap or disorder at {token}")
                test.assertEqual(got, rows[token], f"{context} {key}: rows of {token}")
                previous = token
                if token <= before:
                    reapplied += 1
                else:
                    union[key].append(token)
            last_applied[key] = max(before, previous)
        # Linear position, line by line.
        test.assertIsNotNone(run["start_linear"], f"{context}: no start line in the -v log")
        # Complete when the run started: each writer's rows up to the
        # position its store recovered (persisted by that writer).
        started_complete = {
            t for w, position in run["start_linear"].items() for t in expected[("events", w)] if t <= position
        }
        for kind, stream, _writer, token, linear in run["log"]:
            if stream != "events":
                continue
            if kind == "applied":
                applied_events.add(token)
            missing = [t for t in all_events if t <= linear and t not in applied_events and t not in started_complete]
            test.assertEqual(missing, [], f"{context}: linear {linear} passed rows not yet applied")
            linear_checks += 1
    for key, rows in expected.items():
        test.assertEqual(union[key], sorted(t for t in rows if t > first["resume"].get(key, 0)), f"{name} {key}")
    return {
        "runs": len(runs),
        "tokens": sum(len(v) for v in union.values()),
        "reapplied": reapplied,
        "most_again": most_again,
        "cut": cut,
        "linear_checks": linear_checks,
    }
