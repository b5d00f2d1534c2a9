"""What an operator runs (issue 26), through the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import tempfile

from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from signedjson.sign import sign_json
from twisted.internet import threads
from twisted.trial import unittest

from roomstore.cli.demo import SAMPLE_PATH
from roomstore.demo.sample import write_sample
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import get_room_version
from tests.db import on_both_engines
from tests.test_cli import run_cli


def rewrite(path: str, out: str, change) -> None:
    """Copy a JSON-lines import file, ``change(number, event)`` applied to each event."""
    with open(path) as src, open(out, "w") as dst:
        for number, line in enumerate(src, start=1):
            obj = json.loads(line)
            event = obj["event"] if "event" in obj else obj
            change(number, event)
            dst.write(json.dumps(obj) + "\n")


def first_message_line(path: str) -> int:
    with open(path) as src:
        for number, line in enumerate(src, start=1):
            obj = json.loads(line)
            if (obj["event"] if "event" in obj else obj)["type"] == "m.room.message":
                return number
    raise AssertionError("no message")


@on_both_engines
class ContentHashCliTests:
    async def cli(self, *args):
        return await threads.deferToThread(run_cli, *args)

    def sample(self) -> str:
        path = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        write_sample(path, rooms=1, events_per_room=60, seed=5)
        return path

    async def test_tampered_body_is_stored_redacted_and_reported(self):
        sample = self.sample()
        target = first_message_line(sample)
        tampered = sample + ".tampered"

        def change(number, event):
            if number == target:
                event["content"]["body"] = "tampered body"

        rewrite(sample, tampered, change)
        url = self.new_database_url()
        code, out, err = await self.cli("import", tampered, "--db", url)
        self.assertEqual(code, 0, err)
        reports = [o for o in out if o.get("error") == "content hash mismatch"]
        self.assertEqual(len(reports), 1, out)
        self.assertEqual(reports[0]["line"], target)
        self.assertEqual(reports[0]["stored"], "redacted")
        summary = out[-1]
        self.assertEqual(summary["redacted_content_hash_mismatch"], 1)
        # Nothing else fails (the sample's fork at its end is resolved).
        self.assertEqual([o["error"] for o in out if "message" in o], [])
        self.assertEqual(summary["signatures"], "not checked: no --keys file given")

        event_id = reports[0]["event_id"]
        with open(tampered) as src:
            line = next(text for number, text in enumerate(src, start=1) if number == target)
        obj = json.loads(line)
        room_id = obj.get("event", obj)["room_id"]  # a message: it names its room
        code, out, err = await self.cli(
            "messages", room_id, "--user", "@user0:example.org", "--limit", "200", "--db", url
        )
        self.assertEqual(code, 0, err)
        served = {e["event_id"]: e for e in out if "event_id" in e}
        self.assertEqual(served[event_id]["content"], {})  # never the tampered body
        self.assertNotIn("tampered body", json.dumps(out))

        # --strict refuses it (and what hangs on it), exit 1.
        strict_url = self.new_database_url()
        code, out, err = await self.cli("import", tampered, "--strict", "--db", strict_url)
        self.assertEqual(code, 1, err)
        refused = [o for o in out if o.get("line") == target]
        self.assertEqual(refused[0]["error"], "ContentHashMismatch")
        self.assertIn(event_id, refused[0]["message"])
        self.assertIn("content hash mismatch", refused[0]["message"])
        self.assertEqual(out[-1]["redacted_content_hash_mismatch"], 0)

    async def test_signatures_checked_with_keys(self):
        sample = self.sample()
        key = generate_signing_key("k1")
        keys_path = sample + ".keys.json"
        with open(keys_path, "w") as handle:
            json.dump({"example.org": {"ed25519:k1": encode_verify_key_base64(get_verify_key(key))}}, handle)
        version = get_room_version("10")

        def sign(number, event):
            redacted = prune_event_dict(version, event)
            sign_json(redacted, "example.org", key)
            event["signatures"] = {"example.org": redacted["signatures"]["example.org"]}

        signed = sample + ".signed"
        rewrite(sample, signed, sign)
        url = self.new_database_url()
        code, out, err = await self.cli("import", signed, "--keys", keys_path, "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual(out[-1]["signatures"], {"checked": out[-1]["imported"], "unchecked_no_key": 0})

        # A signature broken on one line: that event is refused, reported.
        broken = sample + ".broken"

        def break_one(number, event):
            sign(number, event)
            if number == 3:
                event["signatures"]["example.org"]["ed25519:k1"] = "A" * 86

        rewrite(sample, broken, break_one)
        code, out, err = await self.cli("import", broken, "--keys", keys_path, "--db", self.new_database_url())
        self.assertEqual(code, 0, err)
        line3 = [o for o in out if o.get("line") == 3]
        self.assertEqual(line3[0]["error"], "InvalidSignature")
        self.assertIn("bad signature by example.org", line3[0]["message"])

        # Signed with a key ID the file does not list (the sample's placeholder
        # "ed25519:a"): stored, counted as unchecked.
        code, out, err = await self.cli("import", sample, "--keys", keys_path, "--db", self.new_database_url())
        self.assertEqual(code, 0, err)
        self.assertGreater(out[-1]["imported"], 50)
        self.assertEqual(out[-1]["signatures"], {"checked": 0, "unchecked_no_key": out[-1]["imported"]})


class SampleHashTests(unittest.TestCase):
    def test_the_bundled_sample_imports_with_no_mismatch(self):
        db = os.path.join(tempfile.mkdtemp(), "s.db")
        code, out, err = run_cli("import", SAMPLE_PATH, "--db", f"sqlite:///{db}")
        self.assertEqual(code, 0, err)
        self.assertEqual(out[-1]["redacted_content_hash_mismatch"], 0)
        self.assertFalse([o for o in out if o.get("error") == "content hash mismatch"])
        self.assertEqual(out[-1]["imported"], 4004)

    def test_a_bad_keys_file_is_one_line(self):
        directory = tempfile.mkdtemp()
        keys = os.path.join(directory, "keys.json")
        with open(keys, "w") as handle:
            handle.write('{"example.org": {"ed25519:k1": "nope"}}')
        code, out, err = run_cli("import", SAMPLE_PATH, "--keys", keys, "--db", f"sqlite:///{directory}/x.db")
        self.assertEqual(code, 2)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("--keys", err)


READ_COMMANDS = {
    "stats": [],
    "state": ["$" + "A" * 43],
    "messages": ["!room0:example.org", "--user", "@user0:example.org"],
    "sync": ["--user", "@user0:example.org"],
    "recent": ["--user", "@user0:example.org"],
}


def tree(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


class ReadCommandsWriteNothingTests(unittest.TestCase):
    def test_an_empty_file_stays_empty(self):
        directory = tempfile.mkdtemp(prefix="roomstore-readonly-")
        path = os.path.join(directory, "empty.db")
        open(path, "wb").close()
        for command, extra in READ_COMMANDS.items():
            code, out, err = run_cli(command, *extra, "--db", f"sqlite:///{path}")
            self.assertEqual(code, 2, err)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertIn("has no roomstore schema", err)
            self.assertIn("roomstore init", err)
            self.assertEqual(tree(directory), {"empty.db": b""}, command)

    def test_reads_of_a_store_leave_every_file_as_it_was(self):
        directory = tempfile.mkdtemp(prefix="roomstore-readonly-")
        sample = os.path.join(directory, "sample.jsonl")
        write_sample(sample, rooms=1, events_per_room=60, seed=4)
        db = os.path.join(directory, "store.db")
        code, imported, err = run_cli("import", sample, "--db", f"sqlite:///{db}")
        self.assertEqual(code, 0, err)
        before = tree(directory)
        self.assertEqual(sorted(before), ["sample.jsonl", "store.db", "store.db.writer-lock"])
        for command, extra in READ_COMMANDS.items():
            code, out, err = run_cli(command, *extra, "--db", f"sqlite:///{db}")
            self.assertIn(code, (0, 2), err)
            self.assertEqual(tree(directory), before, command)  # no byte changed, no -wal/-shm left
        code, out, err = run_cli("stats", "--db", f"sqlite:///{db}")
        self.assertEqual(code, 0, err)
        self.assertEqual({r["table"]: r["rows"] for r in out}["events"], imported[-1]["imported"])


@on_both_engines
class ReadOnlyAndBadLineTests:
    async def cli(self, *args):
        return await threads.deferToThread(run_cli, *args)

    async def test_read_commands_on_a_database_without_schema_create_nothing(self):
        url = self.new_database_url()
        if url.startswith("sqlite"):
            open(url[len("sqlite:///") :], "wb").close()
        for command, extra in READ_COMMANDS.items():
            code, out, err = await self.cli(command, *extra, "--db", url)
            self.assertEqual(code, 2, err)
            self.assertIn("has no roomstore schema", err)
        db = await self.make_database(url, prepare=False)
        tables = await db.run_interaction(
            "tables",
            lambda t: t.engine.table_exists(t._cursor, "events") or t.engine.table_exists(t._cursor, "schema_version"),
        )
        await db.close()
        self.assertFalse(tables)

    async def test_truncated_and_bad_lines_are_reported_and_the_rest_imported(self):
        directory = tempfile.mkdtemp(prefix="roomstore-badline-")
        sample = os.path.join(directory, "sample.jsonl")
        write_sample(sample, rooms=1, events_per_room=20, seed=6)
        with open(sample, "rb") as handle:
            lines = handle.read().splitlines()
        good = lines[:10]
        damaged = os.path.join(directory, "damaged.jsonl")
        with open(damaged, "wb") as handle:
            handle.write(
                b"\n".join(
                    good[:5]
                    + [b"\xff\xfe not utf-8", b'{"room_version": 10, "event": {}}']
                    + good[5:]
                    + [lines[10][: len(lines[10]) // 2]]
                )
            )
        url = self.new_database_url()
        code, out, err = await self.cli("import", damaged, "--db", url)
        self.assertEqual(code, 0, err)
        bad = [o for o in out if o.get("error") == "BadLine"]
        self.assertEqual([o["line"] for o in bad], [6, 7, 13])
        self.assertIn("truncated", bad[-1]["message"])
        self.assertEqual(out[-1]["imported"], 10)
        self.assertEqual(out[-1]["failed"], 3)
        code, out, err = await self.cli("import", damaged, "--db", url, "--strict")
        self.assertEqual(code, 1, err)
        self.assertEqual(out[-1]["already_present"], 10)
