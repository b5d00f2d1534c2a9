"""``roomstore-compact --synapse`` against a live Synapse: what Synapse serves
after a run, a kill inside the open swap transaction, and Synapse's own
deletion of unreferenced state groups meeting a swap.

Real processes throughout: Synapse on the test PostgreSQL server (its own
instance where the test restarts it, the shared one of ``bin/test``
otherwise, under :func:`exclusive`), the job through ``bin/roomstore-compact``
(spark-submit on ``local[2]``), SIGKILL for the kill. Oracles: Synapse's
client API (``/rooms/{id}/state``, ``/rooms/{id}/context/{event}``) and its
own state read (``SynapseOracle``) for every group. The job's hidden
``--swap-hold`` option holds each swap's transaction open, every statement
run, before COMMIT, printing ``swap transaction open: ...``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.parse
from typing import Any

from twisted.trial import unittest

from tests.compaction.test_spark_job import FAST_START, WRAPPER, job_env
from tests.compaction.test_synapse_job import (
    PREFIX,
    SynapseOracle,
    all_groups,
    exclusive,
    insert_chain_room,
    representation,
    run_job,
    synapse_server,
)
from tests.db import pg_query

HOLD_LINE = "swap transaction open: room_nid "


def _without_age(value: Any) -> Any:
    """A client API answer without what changes with the clock (``age``)."""
    if isinstance(value, dict):
        return {k: _without_age(v) for k, v in value.items() if k != "age"}
    if isinstance(value, list):
        return [_without_age(v) for v in value]
    return value


def _log_errors(path: str, offset: int) -> list[str]:
    with open(path) as f:
        f.seek(offset)
        return [line for line in f if " - ERROR - " in line]


class _HeldJob:
    """The job started in the background with ``--swap-hold``; its output read as it comes."""

    def __init__(self, dsn: str, *args: str) -> None:
        self.out = tempfile.TemporaryFile(mode="w+")
        cmd = [WRAPPER, "--master", "local[2]", *FAST_START, "--synapse", dsn, "--heartbeat", "1", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, env=job_env(), start_new_session=True
        )

    def output(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def held_chunk(self, test: unittest.TestCase, seconds: float = 600) -> tuple[int, int]:
        """``(room_nid, first_group)`` of the first swap held open (waits for it)."""
        deadline = time.monotonic() + seconds
        while True:
            text = self.output()
            for line in text.splitlines():
                if line.startswith(HOLD_LINE):
                    nid, _, first = line[len(HOLD_LINE) :].partition(" chunk ")
                    return int(nid), int(first)
            test.assertIsNone(self.proc.poll(), text)
            test.assertLess(time.monotonic(), deadline, text)
            time.sleep(0.1)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.out.close()


def _open_swap_backends(dsn: str) -> list[tuple]:
    """Sessions of this database idle inside a transaction whose last
    statement deleted the job's staged rows (the swap's last statement)."""
    return pg_query(
        dsn,
        "SELECT pid, state FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND state = 'idle in transaction' AND query LIKE %s",
        (f"%{PREFIX}staged%",),
    )


class SynapseServesTheSameAfterARunTests(unittest.TestCase):
    """Synapse started again on the compacted database serves ``/rooms/{id}/state``
    and ``/context`` of every event as before the run."""

    timeout = 1800

    def test_state_and_context_of_every_event_unchanged_after_restart(self) -> None:
        from tests.synapse_server import SynapseServer, restart, start, stop

        pg_url = os.environ.get("ROOMSTORE_TEST_POSTGRES")
        if not pg_url:
            raise unittest.SkipTest("no test PostgreSQL server (run with bin/test)")
        folder = start(pg_url)
        self.addCleanup(stop, folder)
        server = SynapseServer(folder)
        dsn = server.database
        tag = os.urandom(3).hex()
        alice = server.register(f"ralice{tag}")
        others = [server.register(f"r{n}{tag}") for n in range(4)]
        room = alice.create_room(name="restart", topic="t0")
        # More than 100 state events: Synapse stores a full snapshot after 100
        # hops, which the job (allowed longer chains than Synapse writes)
        # turns back into a delta: rows saved, groups rewritten.
        inside: set = set()
        for i in range(130):
            user = others[i % len(others)]
            if i % 5 == 0:
                if user.user_id in inside:
                    user.leave(room)
                    inside.discard(user.user_id)
                else:
                    alice.invite(room, user.user_id)
                    user.join(room)
                    inside.add(user.user_id)
            alice.state(room, "m.room.topic", {"topic": f"t{i + 1}"})
            if i % 3 == 0:
                alice.send(room, f"message {i}")
        events = alice.messages_back(room)
        self.assertIsInstance(events, list)
        self.assertGreater(len(events), 200)

        def served() -> dict[str, Any]:
            path = alice._room(room)
            out: dict[str, Any] = {
                "state": sorted(
                    (_without_age(e) for e in alice._call("GET", path + "/state")),
                    key=lambda e: (e["type"], e["state_key"]),
                )
            }
            for event_id in events:
                context = alice._call(
                    "GET", f"{path}/context/{urllib.parse.quote(event_id, safe='')}", query={"limit": "0"}
                )
                out[event_id] = {
                    "event": _without_age(context["event"]),
                    "state": sorted(
                        (_without_age(e) for e in context["state"]), key=lambda e: (e["type"], e["state_key"])
                    ),
                }
            return out

        # What Synapse serves from its database, not from what it kept in
        # memory while it made the events (some unsigned fields differ).
        restart(folder)
        before = served()
        # A context's state is the room's state at that event: it changes along the room.
        self.assertGreater(len({repr(v["state"]) for k, v in before.items() if k != "state"}), 100)
        oracle = SynapseOracle()
        groups = all_groups(dsn)
        states_before = oracle.states(dsn, groups)
        stored_before = representation(dsn)
        log = os.path.join(folder, "homeserver.log")
        log_offset = os.path.getsize(log) if os.path.exists(log) else 0

        # The run, beside the running Synapse.
        status, out, summary = run_job(dsn, "--rooms", room, "--chunk-groups", "50", "--max-hops", "400")
        self.assertEqual(status, 0, out)
        self.assertEqual(summary["totals"]["mismatched_groups"], 0, out)
        self.assertEqual([r["status"] for r in summary["rooms"]], ["written"], out)
        self.assertLess(summary["totals"]["rows_after"], summary["totals"]["rows_before"], out)
        self.assertNotEqual(representation(dsn), stored_before)  # the groups were rewritten
        self.assertEqual(oracle.states(dsn, groups), states_before)

        # Synapse again, on the compacted database: its caches are gone, what it serves it reads.
        restart(folder)
        self.assertEqual(served(), before)
        self.assertEqual(_log_errors(log, log_offset), [])


class KillInsideTheSwapTransactionTests(unittest.TestCase):
    """SIGKILL while a swap's transaction is open (every statement run, no
    COMMIT yet): nothing of that chunk is written, Synapse's reads during the
    open transaction and after see the old states, and a rerun ends verified."""

    timeout = 1800

    def test_killed_inside_the_open_swap_then_rerun(self) -> None:
        server = synapse_server()
        self.addCleanup(exclusive(server).close)  # nobody else writes to Synapse meanwhile
        dsn = server.database
        tag = os.urandom(3).hex()
        rooms = [f"!held{tag}{n}:synapse.test" for n in range(2)]
        for n, room in enumerate(rooms):
            insert_chain_room(dsn, room, 320, seed=40 + n)
        spec = ",".join(rooms)
        oracle = SynapseOracle()
        groups = all_groups(dsn)
        before = oracle.states(dsn, groups)
        stored_before = representation(dsn)

        job = _HeldJob(dsn, "--rooms", spec, "--chunk-groups", "100", "--swap-hold", "600")
        self.addCleanup(job.close)
        room_nid, first_group = job.held_chunk(self)
        # The transaction is open: its session is idle inside it, its writes invisible to others.
        self.assertEqual(len(_open_swap_backends(dsn)), 1, job.output())
        self.assertEqual(oracle.states(dsn, groups), before)
        self.assertEqual(representation(dsn), stored_before)
        job.kill()

        # The server rolls the transaction back when the session ends.
        deadline = time.monotonic() + 30
        while _open_swap_backends(dsn):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.1)
        self.assertEqual(representation(dsn), stored_before)
        self.assertEqual(oracle.states(dsn, groups), before)
        run_id = pg_query(dsn, f"SELECT run_id FROM {PREFIX}runs WHERE finished_ts IS NULL")
        self.assertEqual(len(run_id), 1)
        self.assertEqual(
            pg_query(
                dsn,
                f"SELECT COUNT(*) FROM {PREFIX}chunks WHERE run_id = %s AND room_nid = %s AND first_group = %s",
                (run_id[0][0], room_nid, first_group),
            ),
            [(0,)],
        )
        # The staged rows of the killed swap are still there for the rerun.
        self.assertGreater(
            pg_query(
                dsn,
                f"SELECT COUNT(*) FROM {PREFIX}staged_groups WHERE run_id = %s AND room_nid = %s AND first_group = %s",
                (run_id[0][0], room_nid, first_group),
            )[0][0],
            0,
        )

        status, output, summary = run_job(dsn, "--rooms", spec, "--chunk-groups", "100")
        self.assertEqual(status, 0, output)
        self.assertIn("resuming run", output)
        self.assertEqual(summary["totals"]["mismatched_groups"], 0, output)
        self.assertEqual(sorted(r["status"] for r in summary["rooms"]), ["written", "written"], output)
        self.assertNotEqual(representation(dsn), stored_before)
        self.assertEqual(oracle.states(dsn, groups), before)
        self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}runs WHERE finished_ts IS NULL"), [(0,)])
        self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}lock"), [(0,)])
        self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}staged_groups"), [(0,)])


class SynapseDeletionMeetsTheSwapTests(unittest.TestCase):
    """Synapse's own deletion of unreferenced state groups (its background
    loop, once a minute) against a swap: it waits on the swap's row locks and,
    retried after the swap commits, de-deltas the groups the swap rebased onto
    the group it deletes; a group Synapse deleted under the job, or that
    became pending deletion under it, is left alone and counted, never an
    error."""

    timeout = 1800

    def test_synapse_deletion_waits_for_the_swap_and_deleted_or_pending_groups_are_left_alone(self) -> None:
        server = synapse_server()
        self.addCleanup(exclusive(server).close)  # nobody else writes to Synapse meanwhile
        dsn = server.database
        tag = os.urandom(3).hex()
        room = f"!gone{tag}:synapse.test"
        ids = insert_chain_room(dsn, room, 420, seed=70)
        oracle = SynapseOracle()
        groups = all_groups(dsn)
        before = oracle.states(dsn, groups)
        log = os.path.join(server.folder, "homeserver.log")
        log_offset = os.path.getsize(log)
        tmp = tempfile.mkdtemp()
        release = os.path.join(tmp, "release")
        summary_path = os.path.join(tmp, "summary.json")

        job = _HeldJob(
            dsn,
            "--rooms",
            room,
            "--chunk-groups",
            "100",
            "--swap-hold",
            "400",
            "--swap-hold-release",
            release,
            "--summary-json",
            summary_path,
        )
        self.addCleanup(job.close)
        room_nid, first_group = job.held_chunk(self)
        run_id = pg_query(dsn, f"SELECT run_id FROM {PREFIX}runs WHERE finished_ts IS NULL")[0][0]
        key = (run_id, room_nid, first_group)
        # A group the held swap makes a new base of other groups (their new edges point at it).
        bases = pg_query(
            dsn,
            f"SELECT new_prev, array_agg(state_group ORDER BY state_group) FROM {PREFIX}staged_groups"
            " WHERE run_id = %s AND room_nid = %s AND first_group = %s AND rewrite = 1 AND is_ref = 0"
            " AND new_prev IS NOT NULL GROUP BY new_prev ORDER BY COUNT(*) DESC, new_prev LIMIT 1",
            key,
        )
        self.assertTrue(bases, job.output())
        doomed, rebased = bases[0]
        # A group of the room's last chunk (not locked by the held swap), due
        # for deletion earlier than the doomed one: Synapse deletes it first,
        # under the job, before the job swaps that chunk.
        deleted_early = ids[-10]
        # A group of the last chunk that becomes pending deletion now (too
        # recent for Synapse to delete during the test).
        pending = ids[-3]
        now_ms = int(time.time() * 1000)
        # No event refers to them any more and they have been pending deletion
        # for longer than Synapse's delay (10 minutes): Synapse's next loop
        # deletes them, oldest first. One statement: the loop sees both or neither.
        pg_query(dsn, "DELETE FROM event_to_state_groups WHERE state_group IN (%s, %s)", (doomed, deleted_early))
        pg_query(
            dsn,
            "INSERT INTO state_groups_pending_deletion (state_group, insertion_ts) VALUES (%s, %s), (%s, %s), (%s, %s)",
            (deleted_early, now_ms - 12 * 60 * 1000, doomed, now_ms - 11 * 60 * 1000, pending, now_ms),
        )

        # Synapse's deletion takes the doomed group's row lock (FOR UPDATE) and waits for the open swap.
        deadline = time.monotonic() + 150
        while not pg_query(
            dsn,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND query LIKE %s",
            ("%FROM state_groups%FOR UPDATE%",),
        ):
            self.assertIsNone(job.proc.poll(), job.output())
            self.assertLess(time.monotonic(), deadline, "Synapse's deletion never waited on the swap")
            time.sleep(0.2)
        self.assertEqual(pg_query(dsn, "SELECT COUNT(*) FROM state_groups WHERE id = %s", (doomed,)), [(1,)])
        self.assertEqual(pg_query(dsn, "SELECT COUNT(*) FROM state_groups WHERE id = %s", (deleted_early,)), [(0,)])
        open(release, "w").close()
        self.assertEqual(job.proc.wait(timeout=600), 0, job.output())
        output = job.output()

        # Retried on what the swap committed, Synapse's deletion removed the group and kept its new children whole.
        deadline = time.monotonic() + 120
        while pg_query(dsn, "SELECT COUNT(*) FROM state_groups WHERE id = %s", (doomed,)) != [(0,)]:
            self.assertLess(time.monotonic(), deadline, "Synapse did not delete the group")
            time.sleep(0.5)
        present = set(all_groups(dsn))
        kept = [g for g in groups if g in present]
        self.assertEqual(sorted(set(groups) - present), sorted([doomed, deleted_early]))
        self.assertEqual(oracle.states(dsn, kept), {g: before[g] for g in kept})
        self.assertTrue(set(rebased) <= present)
        import json

        with open(summary_path) as f:
            summary = json.load(f)
        self.assertEqual(summary["totals"]["mismatched_groups"], 0, output)
        (outcome,) = summary["rooms"]
        self.assertEqual(outcome["status"], "changed_underneath", output)
        # The last chunk is refused, nothing of it written: one group gone, one pending deletion.
        self.assertIn(f"state group {deleted_early} no longer exists", output)
        self.assertIn(f"state group {pending} is pending deletion", output)
        self.assertEqual(pg_query(dsn, "SELECT COUNT(*) FROM state_groups WHERE id = %s", (pending,)), [(1,)])
        self.assertEqual(_log_errors(log, log_offset), [])
