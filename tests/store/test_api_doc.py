"""The embedding example in docs/api.md runs as written, on both engines."""

from __future__ import annotations

import os
import re

from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")


def embedding_example() -> str:
    text = open(DOC, encoding="utf-8").read()
    section = text.split("## Embedding", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


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
