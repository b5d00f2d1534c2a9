"""``stored_pdu`` reads back what ``parse_pdu`` accepted: the same ParsedPdu,
for every room version's events (v1/v2 references, v12 create events without
a room ID, redactions of both layouts, members)."""

from __future__ import annotations

from twisted.trial import unittest

from roomstore.demo.sample import RoomGraphBuilder
from roomstore.pdu.parsing import parse_pdu, stored_pdu

ALICE = "@alice:example.org"


class StoredPduTests(unittest.TestCase):
    def test_the_same_as_parse_pdu_in_every_room_version(self):
        for version in ("1", "2", "3", "5", "6", "10", "11", "12"):
            room = RoomGraphBuilder(room_id="!stored:example.org", version=version, creator=ALICE)
            room.create()
            room.join(ALICE)
            message = room.message(ALICE, "hello")
            room.redact(ALICE, message.event_id)
            room.state("m.room.topic", "", {"topic": "t"})
            for built in room.events:
                parsed = parse_pdu(built.raw, room.room_version)
                stored = stored_pdu(built.raw, room.room_version, parsed.event_id)
                self.assertEqual(stored, parsed, (version, built.event["type"]))
                self.assertEqual(
                    (stored.content, stored.event_dict, stored.auth_chain_event_ids),
                    (parsed.content, parsed.event_dict, parsed.auth_chain_event_ids),
                )

    def test_bytes_that_are_not_a_pdu_raise(self):
        room = RoomGraphBuilder(version="10")
        for raw in (b"[]", b"{}", b'{"type": 1}', b"not json"):
            with self.assertRaises((ValueError, KeyError, TypeError)):
                stored_pdu(raw, room.room_version, "$x")
