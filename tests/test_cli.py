"""The roomstore command, run as a real process, on both engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from twisted.internet import threads

from roomstore.cli.demo import SAMPLE_PATH
from roomstore.demo.sample import write_sample
from roomstore.storage import SCHEMA_VERSION
from roomstore.storage.schema import DEFAULT_SCHEMA_DIR
from tests.db import on_both_engines
from tests.test_architecture import schema_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str) -> tuple[int, list[dict], str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "roomstore.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines, proc.stderr


@on_both_engines
class CliTests:
    async def cli(self, *args):
        return await threads.deferToThread(run_cli, *args)

    async def test_init_import_state_stats(self):
        url = self.new_database_url()
        code, out, err = await self.cli("init", "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual(out[0]["schema_version"], SCHEMA_VERSION)
        self.assertEqual({o["stream"] for o in out[1:]}, {"events", "backfill", "caches"})

        sample = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        self.addCleanup(os.remove, sample)
        count = write_sample(sample, rooms=2, events_per_room=150, seed=3)
        code, out, err = await self.cli("import", sample, "--db", url)
        self.assertEqual(code, 0, err)
        summary = out[-1]
        # The last room ends with a fork on its topic and a merge: resolved, all imported.
        self.assertEqual((summary["imported"], summary["failed"]), (count, 0))
        self.assertEqual(out[:-1], [])
        self.assertEqual(summary["current_token"], f"s{summary['imported']}")

        # Importing again changes nothing, the events stream included.
        code, out, err = await self.cli("import", sample, "--db", url)
        self.assertEqual(out[-1]["already_present"], summary["imported"])
        self.assertEqual(out[-1]["imported"], 0)
        self.assertEqual(out[-1]["current_token"], summary["current_token"])

        code, out, err = await self.cli("stats", "--db", url)
        self.assertEqual(code, 0, err)
        counts = {row["table"]: row["rows"] for row in out}
        # Every table of the schema, none left out.
        self.assertEqual(set(counts), schema_tables(DEFAULT_SCHEMA_DIR))
        self.assertEqual(counts["events"], summary["imported"])
        self.assertEqual(counts["event_json"], summary["imported"])
        self.assertEqual(counts["rooms"], 2)

        code, out, err = await self.cli("state", "--db", url, "$" + "A" * 43)
        self.assertEqual(code, 2)
        self.assertIn("unknown event", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)  # NotFoundError: one line, exit 2

    async def test_state_command(self):
        url = self.new_database_url()
        sample = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        self.addCleanup(os.remove, sample)
        write_sample(sample, rooms=1, events_per_room=40, seed=5)
        await self.cli("import", sample, "--db", url)
        lines = [json.loads(text) for text in open(sample).read().splitlines()]
        events = [line.get("event", line) for line in lines]
        from roomstore.pdu.hashing import compute_event_id
        from roomstore.pdu.room_versions import get_room_version

        version = get_room_version(events[0]["content"]["room_version"])
        join_id = compute_event_id(version, events[1])
        code, out, err = await self.cli("state", "--db", url, join_id)
        self.assertEqual(code, 0, err)
        keys = {(s["type"], s["state_key"]) for s in out[0]["state"]}
        self.assertEqual(keys, {("m.room.create", ""), ("m.room.member", events[1]["state_key"])})
        code, out, err = await self.cli("state", "--db", url, "--before", join_id)
        self.assertEqual({(s["type"], s["state_key"]) for s in out[0]["state"]}, {("m.room.create", "")})

    async def test_import_in_flight_and_validation_processes(self):
        """The pipelined import (the default, 8 batches in flight; and with a
        validation process) reports and stores what one batch at a time does."""
        sample = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        self.addCleanup(os.remove, sample)
        write_sample(sample, rooms=3, events_per_room=200, seed=5)
        outcomes = []
        for options in (["--in-flight", "1"], [], ["--in-flight", "4", "--validation-processes", "1"]):
            url = self.new_database_url()
            code, out, err = await self.cli("import", sample, "--db", url, "--batch-size", "25", *options)
            self.assertEqual(code, 0, err)
            summary = dict(out[-1])
            del summary["seconds"]
            code, stats, err = await self.cli("stats", "--db", url)
            self.assertEqual(code, 0, err)
            # Rows per transaction, not per event, differ with group commit:
            # the invalidations, and current state deltas (a group's one
            # change where batch by batch each step is a row).
            rows = {
                row["table"]: row["rows"]
                for row in stats
                if row["table"] not in ("cache_invalidations", "current_state_deltas")
            }
            outcomes.append((out[:-1], summary, rows))
        self.assertEqual(outcomes[0][1]["failed"], 0)
        self.assertEqual(outcomes[1], outcomes[0])
        self.assertEqual(outcomes[2], outcomes[0])

    async def test_bad_numbers_are_one_line_errors(self):
        code, out, err = await self.cli("import", SAMPLE_PATH, "--db", self.new_database_url(), "--in-flight", "0")
        self.assertEqual(code, 2)
        self.assertIn("--in-flight: 0 is below 1: give 1 or more", err)
        code, out, err = await self.cli(
            "import", SAMPLE_PATH, "--db", self.new_database_url(), "--validation-processes", "many"
        )
        self.assertEqual(code, 2)
        self.assertIn("--validation-processes: 'many' is not a whole number", err)
        code, out, err = await self.cli("import", SAMPLE_PATH, "--db", self.new_database_url(), "--batch-size", "0")
        self.assertEqual(code, 2)
        self.assertIn("--batch-size: 0 is below 1: give 1 or more", err)


@on_both_engines
class DemoTests:
    async def test_demo_imports_the_bundled_sample_and_reads(self):
        url = self.new_database_url()
        code, out, err = await threads.deferToThread(run_cli, "demo", "--db", url)
        self.assertEqual(code, 0, err)
        summary = next(o for o in out if "import" in o)
        self.assertEqual((summary["imported"], summary["failed"]), (4004, 0))
        shown = {o["demo"] for o in out if "demo" in o}
        self.assertEqual(
            shown,
            {
                "current state",
                "state before a forward extremity",
                "users in room",
                "messages (newest 5)",
                "recent (2 events in 3 rooms)",
                "sync since s0",
                "stats",
            },
        )
        page = next(o for o in out if o.get("demo") == "messages (newest 5)")
        self.assertEqual(len(page["events"]), 5)
        sync = next(o for o in out if o.get("demo") == "sync since s0")
        # 4,004 events stored, 4,004 stream IDs.
        self.assertEqual(sync["next_token"], "s4004")
        # Importing the sample again leaves the stream where it is.
        code, out, err = await threads.deferToThread(run_cli, "import", SAMPLE_PATH, "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual((out[-1]["already_present"], out[-1]["current_token"]), (4004, "s4004"))


@on_both_engines
class CliErrorTests:
    async def test_bad_input_is_a_clear_error(self):
        code, out, err = await threads.deferToThread(run_cli, "init", "--db", "mysql://nope/x")
        self.assertEqual(code, 2)
        self.assertIn("unsupported database scheme", err)
        code, out, err = await threads.deferToThread(
            run_cli, "import", "/nonexistent.jsonl", "--db", self.new_database_url()
        )
        self.assertEqual(code, 2)
        self.assertIn("no such file", err)
