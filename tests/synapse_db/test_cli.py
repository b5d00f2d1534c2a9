"""``roomstore import-synapse`` and ``verify-synapse`` as an operator runs
them: the real CLI in a subprocess, on the Synapse ``bin/test`` started on
SQLite (its history from ``history.py``), into a store of each engine."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile

from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.synapse_db.history import build
from tests.synapse_server import SharedHistory, SynapseServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "roomstore.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@on_both_engines
class ImportSynapseCliTests:
    def setUp(self):
        self.synapse = SynapseServer.from_env("ROOMSTORE_TEST_SYNAPSE")
        self.history = SharedHistory(self.synapse, "import").get(build)
        self.rooms = ",".join(sorted(self.history["rooms"].values()))
        self.folder = tempfile.mkdtemp(prefix="roomstore-cli-synapse-")

    def frozen_copy(self) -> str:
        """A consistent copy of the live Synapse's database (SQLite's backup)."""
        path = os.path.join(self.folder, "homeserver.db")
        source = sqlite3.connect(f"file:{self.synapse.database}?mode=ro", uri=True)
        target = sqlite3.connect(path)
        source.backup(target)
        target.execute("PRAGMA journal_mode = DELETE")
        source.close()
        target.close()
        return path

    def test_import_rerun_and_verify(self):
        copy = self.frozen_copy()
        before = sha256(copy)
        db = self.new_database_url()
        first = run_cli("import-synapse", "--from", copy, "--db", db, "--rooms", self.rooms)
        self.assertEqual((first.returncode, first.stderr), (0, ""), first.stderr)
        summary = lines(first.stdout)[-1]
        self.assertEqual((summary["rooms"], summary["already_present"], summary["skipped"]), (3, 0, {}))
        self.assertGreater(summary["events"], 300)
        self.assertEqual(sha256(copy), before)  # read only: Synapse's file is untouched
        again = lines(
            run_cli("import-synapse", "--from", "sqlite:///" + copy, "--db", db, "--rooms", self.rooms).stdout
        )
        self.assertEqual((again[-1]["events"], again[-1]["already_present"]), (0, summary["events"]))
        self.assertEqual(again[-1]["current_token"], summary["current_token"])  # the stream did not move
        verified = run_cli("verify-synapse", "--from", copy, "--db", db, "--rooms", self.rooms)
        self.assertEqual(verified.returncode, 0, verified.stdout + verified.stderr)
        result = lines(verified.stdout)[-1]
        self.assertEqual((result["differences"], result["events_checked"]), (0, summary["events"]))
        # A redaction Synapse holds that the store lacks: exit 1, the difference named.
        target = sqlite3.connect(copy)
        redaction, redacted = target.execute(
            "SELECT r.event_id, r.redacts FROM redactions AS r JOIN events AS e ON e.event_id = r.event_id"
            " WHERE e.room_id = ? ORDER BY r.event_id LIMIT 1",
            (self.history["rooms"]["main"],),
        ).fetchone()
        target.execute("DELETE FROM redactions WHERE event_id = ?", (redaction,))
        target.commit()
        target.close()
        differs = run_cli("verify-synapse", "--from", copy, "--db", db, "--rooms", self.rooms)
        self.assertEqual(differs.returncode, 1, differs.stderr)
        out = lines(differs.stdout)
        self.assertEqual(
            out[0],
            {"event_id": redacted, "difference": "redaction", "synapse_redacted": False, "roomstore_redacted": True},
        )
        self.assertEqual(out[-1]["redaction_differences"], 1)

    def test_refusals_are_one_line(self):
        copy = self.frozen_copy()
        db = self.new_database_url()
        newer = sqlite3.connect(copy)
        newer.execute("UPDATE schema_version SET version = 95")
        newer.commit()
        newer.close()
        empty = os.path.join(self.folder, "empty.db")
        sqlite3.connect(empty).execute("CREATE TABLE t (x)").connection.close()
        cases = {
            "schema version 95 is not supported: import-synapse reads schema versions 84 to 94": ["--from", copy],
            "is not a Synapse database": ["--from", empty],
            "no Synapse database at": ["--from", os.path.join(self.folder, "missing.db")],
            "--rooms": ["--from", copy, "--rooms", "not-a-room"],
        }
        for expected, args in cases.items():
            result = run_cli("import-synapse", "--db", db, *args)
            self.assertEqual(result.returncode, 2, (expected, result.stderr))
            self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
            self.assertIn(expected, result.stderr)
            self.assertEqual(result.stdout, "")

    async def test_outliers_and_rejected_events_keep_their_flags(self):
        """Synapse's flags, set by hand in a copy of its database (a
        single-server Synapse makes neither): a rejected message in the
        middle of a room and an outlier at its end are imported as such."""
        copy = self.frozen_copy()
        second = self.history["rooms"]["second"]
        conn = sqlite3.connect(copy)
        messages = [
            e
            for (e,) in conn.execute(
                "SELECT event_id FROM events WHERE room_id = ? AND type = 'm.room.message' ORDER BY stream_ordering",
                (second,),
            )
        ]
        rejected, outlier = messages[len(messages) // 2], messages[-1]
        conn.execute("INSERT INTO rejections (event_id, reason, last_check) VALUES (?, 'auth_error', '1')", (rejected,))
        conn.execute("UPDATE events SET rejection_reason = 'auth_error' WHERE event_id = ?", (rejected,))
        conn.execute("UPDATE events SET outlier = 1 WHERE event_id = ?", (outlier,))
        conn.execute("DELETE FROM event_to_state_groups WHERE event_id = ?", (outlier,))
        conn.commit()
        conn.close()
        db = self.new_database_url()
        done = run_cli("import-synapse", "--from", copy, "--db", db, "--rooms", second)
        summary = lines(done.stdout)[-1]
        self.assertEqual((summary["outliers"], summary["rejected"], summary["skipped"]), (1, 1, {}), done.stderr)
        store = await RoomStore.open(db, StoreConfig(read_only=True), create=False)
        self.addCleanup(store.close)
        flags = await store.get_event_flags([rejected, outlier])
        self.assertEqual((flags[rejected].rejected_reason, flags[rejected].outlier), ("auth_error", False))
        self.assertEqual((flags[outlier].rejected_reason, flags[outlier].outlier), (None, True))
        verified = run_cli("verify-synapse", "--from", copy, "--db", db, "--rooms", second)
        self.assertEqual(verified.returncode, 0, verified.stdout)
        result = lines(verified.stdout)[-1]
        # Every event checked; the outlier has no state on either side.
        self.assertEqual(result["events_checked"] - result["states_compared"], 1)

    async def test_a_tampered_event_is_stored_redacted_and_reported(self):
        """A message whose body was changed in Synapse's database (its content
        hash no longer matches) is stored in its redacted form under the same
        ID and reported, as ``roomstore import`` does."""
        copy = self.frozen_copy()
        second = self.history["rooms"]["second"]
        conn = sqlite3.connect(copy)
        event_id, raw = conn.execute(
            "SELECT e.event_id, j.json FROM events AS e JOIN event_json AS j USING (event_id)"
            " WHERE e.room_id = ? AND e.type = 'm.room.message' ORDER BY e.stream_ordering LIMIT 1",
            (second,),
        ).fetchone()
        event = json.loads(raw)
        event["content"]["body"] = "not what was sent"
        conn.execute("UPDATE event_json SET json = ? WHERE event_id = ?", (json.dumps(event), event_id))
        conn.commit()
        conn.close()
        db = self.new_database_url()
        done = run_cli("import-synapse", "--from", copy, "--db", db, "--rooms", second)
        out = lines(done.stdout)
        self.assertEqual(
            out[0],
            {
                "event_id": event_id,
                "room_id": second,
                "stream_ordering": out[0]["stream_ordering"],
                "error": "content hash mismatch",
                "stored": "redacted",
            },
        )
        self.assertEqual((out[-1]["redacted_content_hash_mismatch"], out[-1]["skipped"]), (1, {}))
        store = await RoomStore.open(db, StoreConfig(read_only=True), create=False)
        self.addCleanup(store.close)
        served = await store.get_event(event_id)
        self.assertEqual(served["content"], {})  # a message keeps no content when redacted
        self.assertEqual(served["event_id"], event_id)
