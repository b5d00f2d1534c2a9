"""StateGroupStore's full-state reads on hand-written chains, on both engines:
the nearest row of each key wins, a NULL event (written by compaction) removes
the key, and the filtered read agrees with the full one."""

from __future__ import annotations

from roomstore.state.groups import StateGroupNotFound, StateGroupStore
from tests.db import on_both_engines

# group -> (prev group, {type_key_nid: event_nid or None}); ids deliberately not
# in chain order, so nothing may rely on a predecessor having a smaller id.
CHAIN = {
    50: (None, {1: 101, 2: 102, 3: 103, 4: 104}),
    20: (50, {2: 202, 5: 205}),
    70: (20, {2: 302, 3: None}),
    10: (70, {3: 403, 4: None, 6: 406}),
}
EXPECTED = {
    50: {1: 101, 2: 102, 3: 103, 4: 104},
    20: {1: 101, 2: 202, 3: 103, 4: 104, 5: 205},
    70: {1: 101, 2: 302, 4: 104, 5: 205},
    10: {1: 101, 2: 302, 3: 403, 5: 205, 6: 406},
}


def write_chain_txn(txn) -> None:
    for group, (prev, delta) in CHAIN.items():
        txn.execute(
            "INSERT INTO state_groups (state_group, room_nid, prev_state_group, chain_length) VALUES (?, 1, ?, 0)",
            (group, prev),
        )
        for key, event in delta.items():
            txn.execute(
                "INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid) VALUES (?, ?, ?)",
                (group, key, event),
            )


@on_both_engines
class StateGroupReadTests:
    async def test_nearest_row_wins_and_null_removes(self):
        db = await self.make_database()
        await db.run_interaction("write", write_chain_txn)
        groups = StateGroupStore()
        for group, expected in EXPECTED.items():
            state = await db.run_interaction("read", groups.get_state, group)
            self.assertEqual(state, expected, group)
            for keys in ([2, 3, 4], [3], [4, 6, 99]):
                filtered = await db.run_interaction("read", groups.get_state_filtered, group, keys)
                self.assertEqual(filtered, {k: v for k, v in expected.items() if k in keys}, (group, keys))

    async def test_unknown_group(self):
        db = await self.make_database()
        with self.assertRaises(StateGroupNotFound):
            await db.run_interaction("read", StateGroupStore().get_state, 12345)
