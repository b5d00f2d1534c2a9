"""Reading an import file's lines: the quick way for wrapped lines (one
orjson parse) reads every line exactly as the way that judges every line."""

from __future__ import annotations

import json
import os
import tempfile

from twisted.trial import unittest

from roomstore.cli import import_loop
from roomstore.cli.import_loop import read_import_lines

EVENT = {"type": "m.room.message", "content": {"body": "hé \u2603", "n": [1, 2.5, None]}, "depth": 3}
TEXT = json.dumps(EVENT)

#: Lines that are, or look like, wrapped lines; each must read the same either way.
LINES = [
    '{"room_version": "10", "event": %s}'.replace("%s", TEXT),
    '{"room_version":"10","event":%s}'.replace("%s", TEXT.replace(" ", "")),
    '  {\t"room_version" : "9" ,\n"event" :  %s  }  '.replace("%s", TEXT),
    '{"room_version": "10", "event": %s, "event": %s}'.replace("%s", TEXT),  # repeated: the last one
    '{"room_version": "10", "event": %s, "room_version": "9"}'.replace("%s", TEXT),
    '{"room_version": "10", "event": %s, "extra": 1}'.replace("%s", TEXT),  # BadLine
    '{"event": %s, "room_version": "10"}'.replace("%s", TEXT),  # room_version second
    '{"room_version": "1\\u0030", "event": %s}'.replace("%s", TEXT),  # an escape in the version
    '{"room_version": "1\x010", "event": %s}'.replace("%s", TEXT),  # a raw control character: not JSON
    '{"room_version": "10", "event": [1]}',  # BadLine: not an object
    '{"room_version": "10", "event": %s'.replace("%s", TEXT),  # truncated
    '{"room_version": "10", "event": {"a": 1}}}',  # one brace too many
    '{"room_version": "10", "event": {"a": "\\ud800"}}',  # a lone surrogate, which json.loads reads
    '{"room_version": 10, "event": %s}'.replace("%s", TEXT),  # BadLine: not a string
    TEXT,  # a bare event
]


class QuickUnwrapTests(unittest.TestCase):
    def read(self, lines: list[str], quick: bool) -> list:
        if not quick:
            self.patch(import_loop, "_quickly_unwrapped", lambda line: None)
        path = os.path.join(tempfile.mkdtemp(prefix="roomstore-lines-"), "lines.jsonl")
        with open(path, "wb") as f:
            for line in lines:
                f.write(line.encode("utf-8", "surrogatepass") + b"\n")
        f.close()
        return list(read_import_lines(path))

    def test_each_line_reads_the_same_either_way(self):
        for line in LINES:
            self.assertEqual(self.read([line], quick=True), self.read([line], quick=False), line)

    def test_the_usual_wrapped_line_goes_the_quick_way(self):
        taken = []
        real = import_loop._quickly_unwrapped
        self.patch(import_loop, "_quickly_unwrapped", lambda line: taken.append(real(line)) or taken[-1])
        ((number, raw, version),) = self.read([LINES[0]], quick=True)
        self.assertEqual((number, version, json.loads(raw)), (1, "10", EVENT))
        self.assertEqual(taken, [("10", TEXT.encode("utf-8"))])

    def test_a_line_it_does_not_know_goes_the_judging_way(self):
        for line in LINES[3:12] + LINES[13:]:
            self.assertIsNone(import_loop._quickly_unwrapped(line.encode("utf-8", "surrogatepass")), line)
