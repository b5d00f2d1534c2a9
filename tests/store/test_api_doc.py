"""docs/api.md's examples run as written, on both engines: every python block of it is run by a test here (or,
for "A homeserver on the store", by tests/homeserver/test_command.py), and ``test_every_block_is_run`` fails on a
block no test runs. Its public face and errors tables name exactly what ``roomstore`` exports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from signedjson.key import decode_signing_key_base64, encode_verify_key_base64, get_verify_key
from twisted.internet import threads
from twisted.trial import unittest

from roomstore.events.write.persist import EventToPersist
from roomstore.pdu import build_event
from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, get_room_version
from roomstore.pdu.signatures import VerifyKeys, signatures_checked
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")
#: The seed of the key docs/create-event.json is signed with (``ed25519:a`` of example.org; docs/api.md names its
#: verify key): sha256 of "docs/create-event.json", in unpadded base64.
CREATE_EVENT_KEY_SEED = "oa8Z70V7AZACf6q3O7YkitKppOv2d4k/GKi16DwPGhY"


def python_blocks(heading: str) -> list[str]:
    """The python blocks of the section under ``heading``."""
    text = open(DOC, encoding="utf-8").read()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def embedding_example() -> str:
    return python_blocks("## Embedding")[0]


def run_program(source: str, *args: str) -> subprocess.CompletedProcess:
    """``source`` as a script in a fresh Python process (its own reactor)."""
    directory = tempfile.mkdtemp(prefix="roomstore-apidoc-")
    script = os.path.join(directory, "program.py")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(source)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=120, cwd=directory
    )


#: Each section of docs/api.md holding python blocks -> how many; each is run by a test named beside it.
RUN_BLOCKS = {
    "## Embedding": 2,  # test_example_runs, test_default_reactor_program_runs (and the sh line)
    "## Embedding under asyncio": 1,  # test_asyncio_program_runs
    "## Building events": 2,  # test_building_a_v12_room, test_building_every_room_version
    "## Homeserver tables": 1,  # test_embedder_tables_example
    "## Purging": 1,  # PurgingExampleTests
    "## A client-server front": 1,  # test_a_client_server_front
    "## A homeserver on the store": 1,  # tests/homeserver/test_command.py ApiDocTests
}


def table_names(heading: str, column: int) -> set[str]:
    """The backquoted names in ``column`` of the table under ``heading``."""
    text = open(DOC, encoding="utf-8").read()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[column] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`(\w+)`", row)}


class DocumentTests(unittest.TestCase):
    def test_every_block_is_run(self):
        text = open(DOC, encoding="utf-8").read()
        counts = {}
        for section in re.split(r"\n(?=## )", text):
            heading = section.split("\n", 1)[0]
            found = len(re.findall(r"```python\n", section))
            if found:
                counts[heading] = found
        self.assertEqual(counts, RUN_BLOCKS)
        self.assertEqual(re.findall(r"```(\w*)\n", text).count("sh"), 1)  # the embed.py line

    def test_the_public_face_table_names_every_export(self):
        import roomstore

        exported = set(roomstore.__all__) - {"__version__"}
        self.assertEqual(table_names("## The public face", 0), exported)

    def test_the_errors_table_names_every_exported_error(self):
        import roomstore

        errors = {n for n in roomstore.__all__ if isinstance(getattr(roomstore, n), type)}
        errors = {n for n in errors if issubclass(getattr(roomstore, n), Exception)}
        self.assertEqual(table_names("## Errors", 0), errors)
        for name in errors:  # the documented base is the real one
            row = [line for line in open(DOC, encoding="utf-8") if line.startswith(f"| `{name}` |")]
            [base] = re.findall(r"`(\w+)`", row[0].split(" | ")[1])
            bases = {c.__name__ for c in getattr(roomstore, name).__mro__[1:]}
            self.assertIn(base, bases, name)


class EventFileTests(unittest.TestCase):
    def test_the_documented_event_file_is_what_build_event_makes(self):
        # Its signature is real: it verifies with the verify key docs/api.md names, and the file is
        # build_event's output (canonical JSON) with the key of that seed.
        text = open(DOC, encoding="utf-8").read()
        [verify_key] = re.findall(r"key `ed25519:a`, whose verify key is\s+`([A-Za-z0-9+/]{43})`", text)
        key = decode_signing_key_base64("ed25519", "a", CREATE_EVENT_KEY_SEED)
        self.assertEqual(encode_verify_key_base64(get_verify_key(key)), verify_key)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(root, "docs", "create-event.json"), "rb") as handle:
            raw = handle.read()
        built = build_event(
            "10",
            room_id="!example:example.org",
            sender="@alice:example.org",
            type="m.room.create",
            state_key="",
            content={"creator": "@alice:example.org", "room_version": "10"},
            prev_events=[],
            auth_events=[],
            depth=1,
            origin_server_ts=1_700_000_001_000,
            signing_key=key,
        )
        self.assertEqual(raw, built.raw + b"\n")
        keys = VerifyKeys.from_json({"example.org": {"ed25519:a": verify_key}})
        self.assertTrue(signatures_checked(parse_pdu(raw.strip(), get_room_version("10")), keys))


@on_both_engines
class ApiDocTests:
    def test_example_is_at_most_ten_lines(self):
        lines = [line for line in embedding_example().splitlines() if line.strip()]
        self.assertLessEqual(len(lines), 10)

    async def test_example_runs(self):
        namespace: dict = {}
        exec(compile(embedding_example(), "docs/api.md", "exec"), namespace)
        room = RoomBuilder()
        create = room.create()
        event = await namespace["embed"](self.new_database_url(), create.raw)
        self.assertEqual(event["event_id"], create.event_id)
        self.assertEqual(event["type"], "m.room.create")

    async def run_documented_program(self, source: str) -> None:
        room = RoomBuilder()
        create = room.create()
        event_file = os.path.join(tempfile.mkdtemp(prefix="roomstore-apidoc-"), "create.json")
        with open(event_file, "wb") as handle:
            handle.write(create.raw)
        proc = await threads.deferToThread(run_program, source, self.new_database_url(), event_file)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        event = json.loads(proc.stdout)
        self.assertEqual((event["event_id"], event["type"]), (create.event_id, "m.room.create"))

    async def test_default_reactor_program_runs(self):
        example, program = python_blocks("## Embedding")
        await self.run_documented_program(program)  # on its own

    async def test_the_documented_event_file_and_command(self):
        # docs/create-event.json, with the documented line (embed.py = the program block), from the checkout.
        example, program = python_blocks("## Embedding")
        text = open(DOC, encoding="utf-8").read()
        [line] = re.findall(r"^(\.venv/bin/python embed\.py .*?)\s+#", text, re.M)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        directory = tempfile.mkdtemp(prefix="roomstore-apidoc-")
        with open(os.path.join(directory, "embed.py"), "w", encoding="utf-8") as handle:
            handle.write(program)
        url = self.new_database_url()
        words = line.split()
        words[1] = os.path.join(directory, "embed.py")
        words[0] = os.path.join(root, words[0])
        words[2] = url  # this test's database, not var/embed.db
        env = dict(os.environ, PYTHONPATH="")
        proc = await threads.deferToThread(
            subprocess.run, words, capture_output=True, text=True, cwd=root, env=env, timeout=120
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        event = json.loads(proc.stdout)
        with open(os.path.join(root, "docs", "create-event.json"), "rb") as handle:
            created = json.loads(handle.read())
        from roomstore.pdu.hashing import compute_content_hash, compute_event_id
        from roomstore.pdu.room_versions import get_room_version

        self.assertEqual(event["type"], "m.room.create")
        self.assertEqual(event["content"], created["content"])
        self.assertEqual(event["event_id"], compute_event_id(get_room_version("10"), created))
        self.assertEqual(created["hashes"]["sha256"], compute_content_hash(created))  # a valid event to try

    async def test_building_a_v12_room(self):
        source, _ = python_blocks("## Building events")
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        url = self.new_database_url()
        results = await namespace["new_room"](url)
        self.assertEqual(len(results), 3)
        create_id = results[0].event_id
        for result in results:
            self.assertEqual(result.room_id, "!" + create_id[1:])
            self.assertTrue(result.signatures_checked)
            self.assertFalse(result.content_hash_mismatch or result.already_persisted)
        store = await RoomStore.open(url)
        self.addCleanup(store.close)
        self.assertEqual(await store.get_room_version(results[0].room_id), "12")
        hello = await store.get_event(results[2].event_id)
        self.assertEqual(hello["content"]["body"], "hello")
        self.assertEqual(await store.get_users_in_room(results[0].room_id), ["@alice:example.org"])

    async def test_building_every_room_version(self):
        _, source = python_blocks("## Building events")
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        key = decode_signing_key_base64("ed25519", "k", CREATE_EVENT_KEY_SEED)
        keys = VerifyKeys.from_json({"example.org": {"ed25519:k": encode_verify_key_base64(get_verify_key(key))}})
        store = await RoomStore.open(self.new_database_url())
        self.addCleanup(store.close)
        for version in KNOWN_ROOM_VERSIONS:
            create, join, hello, redaction = namespace["first_events"](version, key, f"!v{version}:example.org")
            results = await store.persist_events(
                [EventToPersist(e.raw, version) for e in (create, join, hello, redaction)], verify_keys=keys
            )
            self.assertEqual([r.event_id for r in results], [e.event_id for e in (create, join, hello, redaction)])
            self.assertTrue(all(r.signatures_checked and not r.content_hash_mismatch for r in results), version)
            served = await store.get_event(hello.event_id)
            self.assertEqual(served["content"], {}, version)  # its sender redacted it: authorised
            self.assertEqual(served["unsigned"]["redacted_because"]["event_id"], redaction.event_id, version)
            self.assertEqual(await store.get_room_version(create.room_id), version)

    async def test_embedder_tables_example(self):
        [source] = python_blocks("## Homeserver tables")
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        schema_dir = tempfile.mkdtemp(prefix="roomstore-apidoc-schema-")
        os.makedirs(os.path.join(schema_dir, "1"))
        with open(os.path.join(schema_dir, "1", "01_tokens.sql"), "w", encoding="utf-8") as handle:
            handle.write("CREATE TABLE myhs_tokens (token TEXT PRIMARY KEY, user_id TEXT NOT NULL);\n")
        url = self.new_database_url()
        self.assertIsNone(await namespace["user_of_token"](url, schema_dir, "t0k"))  # migrated, empty
        store = await RoomStore.open(url)
        await store.db.run_interaction(
            "add", lambda txn: txn.execute("INSERT INTO myhs_tokens VALUES (?, ?)", ("t0k", "@alice:example.org"))
        )
        await store.close()
        self.assertEqual(await namespace["user_of_token"](url, schema_dir, "t0k"), "@alice:example.org")

    async def test_asyncio_program_runs(self):
        [program] = python_blocks("## Embedding under asyncio")
        self.assertIn("asyncio.run(", program)
        await self.run_documented_program(program)

    async def test_a_client_server_front(self):
        [source] = python_blocks("## A client-server front")
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        send, sync_rooms = namespace["send"], namespace["sync_rooms"]
        alice, bob = "@alice:example.org", "@bob:example.org"
        store = await RoomStore.open(self.new_database_url())
        self.addCleanup(store.close)
        room = RoomBuilder(room_id="!front:example.org")
        await store.persist_events(
            [
                room.to_persist(e)
                for e in (
                    room.create(),
                    room.join(alice),
                    room.join_rules(),
                    room.history_visibility("shared"),
                    room.member(bob, "invite", sender=alice),
                )
            ]
        )
        initial = await sync_rooms(store, bob, None)
        self.assertEqual(list(initial["rooms"]["invite"]), [room.room_id])
        self.assertEqual(initial["rooms"]["join"], {})
        await store.persist_events([room.to_persist(room.join(bob))])
        sent = []
        for i in range(15):
            built = room.message(bob, f"m{i}")
            self.assertEqual(await send(store, built.raw, "10", bob, "DEV", f"t{i}"), built.event_id)
            sent.append(built.event_id)
        retry = room.message(bob, "m3 again", set_leaves=False)
        self.assertEqual(await send(store, retry.raw, "10", bob, "DEV", "t3"), sent[3])
        self.assertIsNone(await store.get_event(retry.event_id))  # caught by the look-up: never stored

        async def not_yet(*args):  # a racing request: the look-up came before the first one's write
            return None

        store.get_event_id_for_txn = not_yet
        racing = room.message(bob, "m4 racing")
        self.assertEqual(await send(store, racing.raw, "10", bob, "DEV", "t4"), sent[4])
        del store.get_event_id_for_txn

        later = await sync_rooms(store, bob, initial["next_batch"], limit=5)
        joined = later["rooms"]["join"][room.room_id]
        timeline = joined["timeline"]
        self.assertTrue(timeline["limited"])
        self.assertEqual([e["event_id"] for e in timeline["events"]], [*sent[-4:], racing.event_id])
        self.assertIn("age", timeline["events"][0]["unsigned"])
        served, token = [], timeline["prev_batch"]
        while True:
            page = await store.paginate(room.room_id, bob, token, "b", 6)
            if page.next_token is None:
                break
            served += [e["event_id"] for e in page.events]
            token = page.next_token
        self.assertEqual(served[:11], sent[-5::-1])  # every message before the timeline, newest first, once
        self.assertEqual(len(served), len(set(served)))
        self.assertEqual(later["rooms"]["invite"], {})


@on_both_engines
class PurgingExampleTests:
    async def test_purging_example(self):
        [source] = python_blocks("## Purging")
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        url = self.new_database_url()
        room = RoomBuilder()
        events = [room.create(), room.join("@alice:example.org"), room.join_rules(), room.join("@bob:elsewhere.org")]
        events += [
            room.message(sender, f"m{i}") for i in range(6) for sender in ("@alice:example.org", "@bob:elsewhere.org")
        ]
        store = await RoomStore.open(url)
        await store.persist_events([room.to_persist(e) for e in events])
        await store.close()
        result = await namespace["purge_before"](url, room.room_id, events[9].event_id)
        self.assertEqual(result["rows_deleted"]["events"], 3)  # bob's messages up to it; alice is local
        store = await RoomStore.open(url)
        self.addCleanup(store.close)
        self.assertIsNone(await store.get_event(events[5].event_id))
        self.assertIsNotNone(await store.get_event(events[4].event_id))
