"""The embedding example in docs/api.md runs as written, on both engines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from twisted.internet import threads

from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")


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
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=120,
                          cwd=directory)


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
            subprocess.run, words, capture_output=True, text=True, cwd=root, env=env, timeout=120)
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

    async def test_asyncio_program_runs(self):
        [program] = python_blocks("## Embedding under asyncio")
        self.assertIn("asyncio.run(", program)
        await self.run_documented_program(program)
