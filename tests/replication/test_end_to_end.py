"""End to end over real loopback TCP with PostgreSQL: a writer, its workers.

The writer is the real ``ReplicationServerService`` (port 0, real reactor)
in the test process. Workers are ``FollowerService``s in the same process, or
``roomstore follow`` child processes that are SIGKILLed and restarted while
the writer keeps persisting.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from twisted.internet import defer
from twisted.trial import unittest

from roomstore.replication.process_services import FollowerService, ReplicationServerService
from tests.db import DatabaseTestMixin

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder

from .store_utils import ALICE, BOB, CAROL, reap, sleep, wait_until, with_timeout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KILLS = 20
#: The streams whose rows the kill test accounts for (backfill stays empty).
CHECKED_STREAMS = ("events", "caches")


class WriterLoop:
    """Persists batches into a few rooms until stopped: messages, joins,
    leaves and state changes, in batches of one to three events, from
    ``lanes`` concurrent loops (on PostgreSQL their IDs complete out of order)."""

    def __init__(self, store, rng: random.Random, lanes: int = 2, pause: float = 0.01) -> None:
        self.store = store
        self.rng = rng
        self.pause = pause
        self.running = True
        self.batches = 0
        self.lanes = [defer.ensureDeferred(self._lane(i)) for i in range(lanes)]

    async def _lane(self, lane: int) -> None:
        rooms = []
        for r in range(2):
            room = UncheckedRoomBuilder(f"!lane{lane}r{r}:example.org")
            await self.store.persist_events([room.to_persist(room.create()), room.to_persist(room.join(ALICE))])
            rooms.append((room, {ALICE}))
        people = [f"@user{i}:example.org" for i in range(8)]
        while self.running:
            room, members = self.rng.choice(rooms)
            batch = []
            for _ in range(self.rng.randint(1, 3)):
                roll = self.rng.random()
                outsiders = [p for p in people if p not in members]
                if roll < 0.15 and outsiders:
                    user = self.rng.choice(outsiders)
                    batch.append(room.join(user))
                    members.add(user)
                elif roll < 0.25 and len(members) > 1:
                    user = self.rng.choice(sorted(members - {ALICE}))
                    batch.append(room.member(user, "leave"))
                    members.discard(user)
                elif roll < 0.30:
                    batch.append(room.state("m.room.topic", "", {"topic": f"t{self.rng.randrange(100)}"}))
                else:
                    batch.append(room.message(self.rng.choice(sorted(members)), f"m{self.batches}"))
            await self.store.persist_events([room.to_persist(e) for e in batch])
            self.batches += 1
            await sleep(self.pause * self.rng.random() * 2)

    async def stop(self) -> None:
        self.running = False
        await defer.gatherResults(self.lanes, consumeErrors=True)


class EndToEndTests(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"
    timeout = 240

    async def start_server(self, url: str, **kw) -> ReplicationServerService:
        service = ReplicationServerService(url, port=0, server_name="hs.example", **kw)
        service.startService()
        self.addCleanup(lambda: service.stopService() if service.running else None)
        await with_timeout(service.when_ready(), 30, "server service")
        return service

    async def start_worker(self, url: str, server: ReplicationServerService, name: str) -> FollowerService:
        worker = FollowerService(
            url, "127.0.0.1", server.port.getHost().port, name=name, expected_server_name="hs.example"
        )
        worker.startService()
        self.addCleanup(lambda: worker.stopService() if worker.running else None)
        await with_timeout(worker.when_ready(), 30, f"{name}")
        await wait_until(lambda: worker.factory.connection is not None, what=f"{name} connected")
        return worker

    async def test_events_reach_both_workers(self):
        url = self.new_database_url()
        server = await self.start_server(url)
        workers = [await self.start_worker(url, server, name) for name in ("worker1", "worker2")]
        writer = server.store
        room = UncheckedRoomBuilder()
        message = room.message
        # Warm the workers' caches with what is about to change.
        for worker in workers:
            self.assertEqual(await worker.store.get_rooms_for_user(BOB), frozenset())
        batches = [
            [room.create(), room.join(ALICE)],
            [message(ALICE, "hello")],
            [room.join(BOB), room.state("m.room.topic", "", {"topic": "replication"})],
            [room.join(CAROL), message(CAROL, "hi")],
        ]
        for batch in batches:
            results = await writer.persist_events([room.to_persist(e) for e in batch])
            token = max(r.stream_ordering for r in results)
            for worker in workers:
                # Wait for the RDATA, then read: the worker sees the batch.
                await with_timeout(worker.store.events_stream.wait_for_position(token), 10, "RDATA on a worker")
                for event in batch:
                    self.assertEqual(
                        await worker.store.get_event(event.event_id), await writer.get_event(event.event_id)
                    )
                self.assertEqual(
                    await worker.store.get_current_state_ids(room.room_id),
                    await writer.get_current_state_ids(room.room_id),
                )
                for user in (ALICE, BOB, CAROL):
                    self.assertEqual(await worker.store.get_rooms_for_user(user), await writer.get_rooms_for_user(user))
        # A redaction drops the cached event on both.
        target = batches[1][0]
        for worker in workers:
            self.assertEqual((await worker.store.get_event(target.event_id))["content"]["body"], "hello")
        redaction = room.redact(ALICE, target.event_id)
        results = await writer.persist_events([room.to_persist(redaction)])
        for worker in workers:
            await with_timeout(worker.store.events_stream.wait_for_position(results[0].stream_ordering), 10, "RDATA")
            redacted = await worker.store.get_event(target.event_id)
            self.assertEqual(redacted["unsigned"]["redacted_because"]["event_id"], redaction.event_id)
            self.assertEqual(worker.store.get_current_token(), writer.get_current_token())
            caches = writer.caches_stream.get_current_token()
            self.assertEqual(
                await with_timeout(worker.store.caches_stream.wait_for_position(caches), 10, "caches"), caches
            )

    async def test_worker_killed_and_restarted_under_continuous_writes(self):
        """A ``roomstore follow`` worker is SIGKILLed at random moments and
        restarted 20 times while two writer loops keep persisting; it resumes
        from its positions file each time.

        What "applied exactly once" means across kills: a token counts as
        applied by a run when the run printed every row of it (the last token
        of a killed run may be cut mid-write; it does not count). The worker
        prints a token's rows before saving its position, and saves off the
        reactor, one write at a time (the newest positions next), so a
        restart resumes at or before the last token the previous runs
        applied: the tokens applied after the last finished write are applied
        again. Asserted: within a run, applied tokens follow the writer's
        tokens with no gap and with exactly the writer's rows; at each
        restart, the resume position leaves no gap (what is re-applied is
        counted and printed); and the union of all runs, each token counted
        once, is every row the writer wrote, in order, from the first run's
        start to the end.
        """
        url = self.new_database_url()
        seed = int(os.environ.get("ROOMSTORE_KILL_SEED", random.randrange(1 << 30)))
        rng = random.Random(seed)
        self.addCleanup(lambda: print(f"kill test seed {seed} (ROOMSTORE_KILL_SEED)"))
        server = await self.start_server(url)
        port = server.port.getHost().port
        directory = tempfile.mkdtemp(prefix="roomstore-kill-")
        positions_file = os.path.join(directory, "positions.json")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        argv = [
            sys.executable,
            "-m",
            "roomstore.cli",
            "follow",
            "--db",
            url,
            "--server",
            f"127.0.0.1:{port}",
            "--name",
            "worker1",
            "--server-name",
            "hs.example",
            "--positions-file",
            positions_file,
        ]
        outputs: list[str] = []
        processes: list[subprocess.Popen] = []

        def spawn() -> subprocess.Popen:
            out = os.path.join(directory, f"run{len(outputs)}.out")
            outputs.append(out)
            with open(out, "wb") as stdout, open(out + ".err", "wb") as stderr:
                proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env)
            processes.append(proc)
            return proc

        self.addCleanup(reap, processes)
        writer = WriterLoop(server.store, rng)
        started = time.monotonic()

        def has_started(path: str) -> bool:
            with open(path, "rb") as handle:
                return b'"following"' in handle.readline()

        for _ in range(KILLS):
            proc = spawn()
            if rng.random() < 0.2:
                # During start-up (opening the store, connecting, replaying).
                await sleep(rng.uniform(0.05, 0.6))
            else:
                # While it applies rows: wait for it to start (however slow
                # the machine), then a random moment later.
                await wait_until(
                    lambda: has_started(outputs[-1]) or proc.poll() is not None, timeout=60, what="a worker to start"
                )
                await sleep(rng.uniform(0.05, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        await writer.stop()
        final = {name: server.store.generators[name].get_current_token() for name in CHECKED_STREAMS}

        # The last run catches up and is stopped cleanly.
        proc = spawn()

        def caught_up() -> bool:
            from roomstore.replication.process_services import load_positions

            saved = load_positions(positions_file) or {}
            return all(saved.get((name, "master"), -1) >= final[name] for name in CHECKED_STREAMS)

        # Started, too: the positions file may already be at the end when the
        # writer wrote nothing after the last kill, and a SIGTERM before the
        # reactor runs (no handler yet) would kill the process outright.
        await wait_until(
            lambda: has_started(outputs[-1]) and caught_up(), timeout=60, what="the last worker to start and catch up"
        )
        proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: proc.poll() is not None, timeout=20, what="the last worker to exit")
        self.assertEqual(proc.returncode, 0, open(outputs[-1] + ".err").read()[-2000:])

        runs = [parse_run(path) for path in outputs]
        # Coverage starts where the first run that got going started.
        start = next(run["resume"] for run in runs if run["resume"] is not None)
        streams = server.factory.streams
        summary = {}
        for name in CHECKED_STREAMS:
            updates = (await streams.get(name).get_updates("master", start[name], final[name], 10**9)).updates
            expected: dict[int, list] = {}
            for token, row in updates:
                expected.setdefault(token, []).append(json.loads(json.dumps(row)))
            summary[name] = check_runs(self, name, runs, start[name], expected)
        applying_runs = sum(1 for r in runs[:-1] if any(r["groups"].get(n) for n in CHECKED_STREAMS))
        self.assertGreaterEqual(applying_runs, KILLS // 2, "most killed runs should have applied rows")
        self.assertGreater(summary["events"]["tokens"], 100)
        elapsed = time.monotonic() - started
        print(
            f"\n{KILLS} kills in {elapsed:.1f}s, {writer.batches} batches, seed {seed}, "
            f"{applying_runs} killed runs applied rows; "
            + "; ".join(
                f"{n}: {s['tokens']} tokens, {s['rows']} rows, {s['reapplied']} re-applied at restarts "
                f"(at most {s['most_again']} at one), "
                f"{s['cut']} cut by a kill"
                for n, s in summary.items()
            )
        )


def parse_run(path: str) -> dict:
    """One run's output: where it resumed from, and per stream its tokens in
    print order with their rows. A final line cut by a kill is dropped."""
    with open(path, "rb") as handle:
        data = handle.read()
    lines = data.split(b"\n")[:-1]  # the last element is "" or a cut line
    resume = None
    groups: dict[str, list[tuple[int, list]]] = {}
    for line in lines:
        obj = json.loads(line)
        if "following" in obj:
            assert resume is None
            resume = {name: tokens["master"] for name, tokens in obj["resume"].items()}
            continue
        assert resume is not None, f"{path}: rows before the start line"
        assert obj["instance"] == "master"
        stream_groups = groups.setdefault(obj["stream"], [])
        if stream_groups and stream_groups[-1][0] == obj["token"]:
            stream_groups[-1][1].append(obj["row"])
        else:
            stream_groups.append((obj["token"], [obj["row"]]))
    return {"path": path, "resume": resume, "groups": groups}


def check_runs(test: unittest.TestCase, name: str, runs: list[dict], start: int, expected: dict[int, list]) -> dict:
    """Check one stream across runs (see the kill test's docstring); returns counts."""
    order = sorted(expected)

    def rows_between(low: int, high: int) -> list[int]:
        """The tokens with rows in (low, high]."""
        return [t for t in order if low < t <= high]

    def next_after(token: int) -> int | None:
        later = [t for t in order if t > token]
        return later[0] if later else None

    applied_union: list[int] = []
    # The newest token applied by any run so far. Positions may also move
    # past tokens without rows (a batch with no invalidations still takes a
    # caches ID), so a resume position is compared by the rows in between.
    last_applied = start
    reapplied = cut = most_again = 0
    for index, run in enumerate(runs):
        context = f"{name} run {index} ({run['path']})"
        if run["resume"] is None:
            test.assertFalse(run["groups"], context)  # killed before it started: applied nothing
            continue
        resume = run["resume"][name]
        # No gap: nothing with rows between what was applied and the resume
        # position (the tokens applied after the last finished write of the
        # positions file are applied again).
        test.assertEqual(rows_between(last_applied, resume), [], f"{context}: skips rows")
        most_again = max(most_again, len(rows_between(resume, last_applied)))
        groups = run["groups"].get(name, [])
        if groups and groups[-1][1] != expected.get(groups[-1][0]):
            # Killed while printing this token: a strict prefix, not applied.
            token, rows = groups.pop()
            test.assertEqual(rows, expected[token][: len(rows)], context)
            test.assertLess(len(rows), len(expected[token]), context)
            cut += 1
        previous = resume
        for token, rows in groups:
            test.assertEqual(token, next_after(previous), f"{context}: gap or disorder at {token}")
            test.assertEqual(rows, expected[token], f"{context}: rows of {token}")
            previous = token
            if token <= last_applied:
                reapplied += 1
            else:
                applied_union.append(token)
        last_applied = max(last_applied, previous)
    # Every token the writer wrote, once, in order.
    test.assertEqual(applied_union, order)
    return {
        "tokens": len(order),
        "rows": sum(len(r) for r in expected.values()),
        "reapplied": reapplied,
        "cut": cut,
        "most_again": most_again,
    }
