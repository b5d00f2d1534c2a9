"""A full disk under ``roomstore import`` on SQLite (issue 24, item 3).

The database file sits on a 2 MB tmpfs the test mounts (root only: ``mount``);
the real command runs in a child process, as an operator runs it. Out of
space it stops with one line saying so (no traceback) and a non-zero exit;
the file passes ``PRAGMA integrity_check``; every event it reported imported
reads back, byte for byte, and nothing else is stored. Once the tmpfs is
grown, the same import completes and nothing is stored twice.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.cli.import_loop import read_import_lines
from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.room_versions import get_room_version
from roomstore.store import RoomStore, StoreConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "roomstore", "data", "sample-rooms.jsonl")


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    )
    return subprocess.run(
        [sys.executable, "-m", "roomstore.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )


class TmpfsMixin:
    def small_tmpfs(self, size: str = "2m") -> str:
        if os.geteuid() != 0:
            raise unittest.SkipTest("mounting a small tmpfs needs root (bin/test runs as root in CI)")
        directory = tempfile.mkdtemp(prefix="roomstore-full-")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", directory], check=True)

        def unmount() -> None:
            if subprocess.run(["umount", directory]).returncode != 0:
                subprocess.run(["umount", "-l", directory])
            os.rmdir(directory)

        self.addCleanup(unmount)
        return directory

    def grow(self, directory: str, size: str = "200m") -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", directory], check=True)


def _stored(path: str) -> tuple[str, list[str]]:
    """The file's integrity check and the event IDs stored, as sqlite3 sees them."""
    conn = sqlite3.connect(path)
    try:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
        ids = [
            row[0]
            for row in conn.execute(
                "SELECT i.event_id FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
            )
        ]
        return check, ids
    finally:
        conn.close()


class DiskFullImportTests(TmpfsMixin, unittest.TestCase):
    async def test_import_onto_a_full_disk_then_again_after_space_is_freed(self):
        directory = self.small_tmpfs()
        path = os.path.join(directory, "full.db")
        url = f"sqlite:///{path}"
        lines = list(read_import_lines(SAMPLE))
        versions: dict[str, str] = {}  # a bare PDU line is of its room's version
        ids_by_line = {}
        for n, raw, version in lines:
            # A v12 create event carries no room_id (its line names its version).
            version = version or versions[json.loads(raw)["room_id"]]
            pdu = parse_pdu(raw, get_room_version(version))
            versions.setdefault(pdu.room_id, version)
            ids_by_line[n] = pdu.event_id
        raw_by_id = {ids_by_line[n]: raw for n, raw, _ in lines}

        first = await threads.deferToThread(_run, "import", SAMPLE, "--db", url)
        self.assertNotEqual(first.returncode, 0)
        self.assertEqual(first.returncode, 2)
        errors = first.stderr.strip().splitlines()
        self.assertEqual(len(errors), 1, first.stderr)  # one line, no traceback
        self.assertNotIn("Traceback", first.stderr)
        self.assertRegex(
            errors[0],
            r"^roomstore import: stopped at line \d+: sqlite:///.* is out of space "
            r"\(database or disk is full\); \d+ events were imported before it",
        )
        self.assertIn("free space and run the same import again", errors[0])
        summary = json.loads(first.stdout.strip().splitlines()[-1])
        self.assertEqual(summary["complete"], False)
        imported, next_line = summary["imported"], summary["next_line"]
        self.assertGreater(imported, 0)
        self.assertLess(next_line, len(lines))  # it really ran out before the end

        check, stored = await threads.deferToThread(_stored, path)
        self.assertEqual(check, "ok")
        # What it reported imported, and nothing more: the lines before the one it stopped at.
        reported = [ids_by_line[n] for n, _, _ in lines if n < next_line]
        self.assertEqual(len(reported), imported)
        self.assertEqual(sorted(stored), sorted(reported))
        store = await RoomStore.open(url, StoreConfig(read_only=True), create=False)
        try:
            for event_id in reported:
                self.assertEqual(await store.get_event_json_bytes(event_id), raw_by_id[event_id], event_id)
        finally:
            await store.close()

        # Space freed: the same import completes, nothing stored twice.
        self.grow(directory)
        second = await threads.deferToThread(_run, "import", SAMPLE, "--db", url)
        self.assertEqual(second.returncode, 0, second.stderr)
        done = json.loads(second.stdout.strip().splitlines()[-1])
        self.assertEqual(done["already_present"], imported)
        self.assertEqual((done["imported"] + done["already_present"], done["failed"]), (len(lines), 0))
        check, stored = await threads.deferToThread(_stored, path)
        self.assertEqual(check, "ok")
        self.assertEqual(len(stored), len(set(stored)))
        self.assertEqual(len(stored), len(lines))  # the whole sample, its fork resolved
        conn = sqlite3.connect(path)
        try:
            orderings = conn.execute("SELECT COUNT(*), COUNT(DISTINCT stream_ordering) FROM events").fetchone()
        finally:
            conn.close()
        self.assertEqual(orderings, (len(lines), len(lines)))
