"""How ``import-synapse`` reads the prev events an event's JSON cites (pure)."""

from __future__ import annotations

import json

from twisted.trial import unittest

from roomstore.synapse_db.importer import _prev_event_ids
from roomstore.synapse_db.source import SynapseEvent


def _event(prev_events: list) -> SynapseEvent:
    raw = json.dumps({"type": "m.room.message", "prev_events": prev_events}).encode()
    return SynapseEvent(1, "$e", "!r:hs", "1", raw, False, None, "m.room.message", None, len(prev_events))


class PrevCitationTests(unittest.TestCase):
    def test_ids_and_v1_pairs_are_read(self):
        self.assertEqual(_prev_event_ids(_event(["$a", ["$b:hs", {"sha256": "x"}]])), ["$a", "$b:hs"])

    def test_what_names_no_event_is_left_out(self):
        # An empty pair used to come through as a list, not an ID.
        self.assertEqual(_prev_event_ids(_event([[], 7, None, [3, {}], "$a"])), ["$a"])
