"""Hand-built cases for the compaction strategies and their entry points."""

import subprocess
import sys

from twisted.trial.unittest import TestCase

from roomstore.compaction import (
    DEFAULT_LEVELS,
    DEFAULT_RETIRED,
    StateGroupEntry,
    StreamingCompactor,
    chain_depths,
    compress_chunks,
    compress_levels,
    compress_room,
    compress_smart,
    count_rows,
    full_states,
    levels_hop_bound,
    max_hops,
    verify,
)
from tests.compaction._builders import apply_plan, chain, chunked, persisted_room

E = StateGroupEntry


def prevs(plan):
    return [e.prev_group for e in plan.entries]


class LevelsTests(TestCase):
    def test_hop_bound(self) -> None:
        self.assertEqual(levels_hop_bound(DEFAULT_LEVELS), 172)
        self.assertEqual(levels_hop_bound((3, 2)), 3)

    def test_levels_structure_on_a_linear_chain(self) -> None:
        # Level 0 holds chains of 3, level 1 chains of 2, then a snapshot.
        groups = chain(*({k: k} for k in range(1, 12)))
        plan = compress_levels(groups, (3, 2))
        self.assertEqual(prevs(plan), [None, 1, 2, None, 4, 5, 4, 7, 8, None, 10])
        self.assertEqual(plan.max_depth, 3)
        self.assertEqual(max_hops(plan), 3)
        self.assertEqual(verify(groups, plan), [])

    def test_rebased_delta_is_the_state_difference(self) -> None:
        # With levels (2, 2): 3 starts level 1 as a snapshot, 5 is rebased
        # from 4 onto 3 and must carry 4's change too.
        groups = chain({1: 10, 2: 20}, {3: 30}, {1: 11}, {4: 40}, {1: 12})
        plan = compress_levels(groups, (2, 2))
        self.assertEqual(prevs(plan), [None, 1, None, 3, 3])
        by_id = {e.group_id: e for e in plan.entries}
        self.assertEqual(by_id[3].delta, {1: 11, 2: 20, 3: 30})
        self.assertEqual(by_id[5].delta, {1: 12, 4: 40})
        self.assertTrue(by_id[5].changed)
        self.assertFalse(by_id[2].changed)
        self.assertFalse(by_id[4].changed)
        self.assertEqual(verify(groups, plan), [])

    def test_tombstone_when_new_base_has_an_extra_key(self) -> None:
        # 4 removed key 2; 5 rebased onto 3 (which has it) needs a tombstone.
        groups = chain({1: 10, 2: 20}, {3: 30}, {5: 50}, {2: None}, {6: 60})
        plan = compress_levels(groups, (2, 2))
        by_id = {e.group_id: e for e in plan.entries}
        self.assertEqual(by_id[5].prev_group, 3)
        self.assertEqual(by_id[5].delta, {2: None, 6: 60})
        self.assertEqual(full_states(plan.entries)[5], {1: 10, 3: 30, 5: 50, 6: 60})

    def test_redundant_stored_rows_are_dropped(self) -> None:
        groups = chain({1: 10}, {1: 10, 2: 20, 9: None})
        plan = compress_levels(groups)
        self.assertEqual(plan.entries[1].delta, {2: 20})
        self.assertTrue(plan.entries[1].changed)
        self.assertEqual(plan.rows_after, 2)

    def test_levels_is_idempotent(self) -> None:
        groups = persisted_room(800, seed=11)
        once = compress_levels(groups, (10, 5))
        twice = compress_levels(once.entries, (10, 5))
        self.assertEqual(twice.changed_entries, ())
        self.assertEqual(twice.rows_after, once.rows_after)

    def test_max_hops_below_levels_bound_is_rejected(self) -> None:
        with self.assertRaises(ValueError):
            StreamingCompactor("levels", levels=(10, 10), max_hops=5)
        with self.assertRaises(ValueError):
            StreamingCompactor("levels", levels=(10, 0))
        with self.assertRaises(ValueError):
            StreamingCompactor("nope")


class SmartTests(TestCase):
    def test_fork_sibling_hangs_off_the_fork_point(self) -> None:
        # 2 and 3 are concurrent branches off 1, interleaved in id order.
        big = {k: k for k in range(100)}
        groups = [
            E(1, None, big),
            E(2, 1, {1000: 1}),
            E(3, 1, {2000: 2}),
            E(4, 2, {1001: 3}),
            E(5, 3, {2001: 4}),
        ]
        levels = compress_levels(groups)
        smart = compress_smart(groups)
        self.assertEqual(prevs(levels), [None, 1, 2, 3, 4])
        self.assertEqual(prevs(smart), [None, 1, 1, 2, 3])
        self.assertEqual(smart.changed_entries, ())
        self.assertLess(smart.rows_after, levels.rows_after)
        self.assertEqual(verify(groups, smart), [])

    def test_reverted_state_is_found_in_the_window(self) -> None:
        # 4 returns to 2's exact state: an empty delta against 2.
        groups = chain({1: 10}, {2: 20}, {2: 21, 3: 30}, {2: 20, 3: None})
        plan = compress_smart(groups)
        self.assertEqual(plan.entries[3].prev_group, 2)
        self.assertEqual(plan.entries[3].delta, {})
        self.assertEqual(verify(groups, plan), [])

    def test_snapshot_when_nothing_is_close(self) -> None:
        groups = [E(1, None, {k: k for k in range(50)}), E(2, 1, {k: None for k in range(50)})]
        groups[1] = E(2, 1, {**groups[1].delta, 99: 1})
        plan = compress_smart(groups)
        self.assertIsNone(plan.entries[1].prev_group)
        self.assertEqual(plan.entries[1].delta, {99: 1})

    def test_never_worse_than_levels_per_group(self) -> None:
        for seed in range(5):
            groups = persisted_room(1200, seed=seed, fork_rate=0.2, keys=60)
            for levels in ((100, 50, 25), (7, 4, 3), (5,)):
                lv = compress_levels(groups, levels)
                sm = compress_smart(groups, levels=levels, window=8)
                for a, b in zip(lv.entries, sm.entries, strict=True):
                    self.assertLessEqual(len(b.delta), len(a.delta), (seed, levels, a.group_id))
                self.assertLessEqual(sm.max_depth, levels_hop_bound(levels))

    def test_respects_a_tight_max_hops(self) -> None:
        groups = persisted_room(600, seed=5)
        for limit in (0, 1, 7, 40):
            plan = compress_smart(groups, max_hops=limit)
            self.assertLessEqual(max_hops(plan), limit)
            self.assertEqual(verify(groups, plan), [])

    def test_slack_beyond_levels_bound_is_used(self) -> None:
        groups = persisted_room(3000, seed=8, fork_rate=0.0)
        tight = compress_smart(groups, levels=(10, 5))
        loose = compress_smart(groups, max_hops=60, levels=(10, 5))
        self.assertLessEqual(tight.max_depth, 13)
        self.assertLessEqual(loose.max_depth, 60)
        self.assertLess(loose.rows_after, tight.rows_after)


class MissingPredecessorTests(TestCase):
    def setUp(self) -> None:
        room = persisted_room(400, seed=21, snapshot_every=50)
        purged = {room[120].group_id}
        self.groups = [g for g in room if g.group_id not in purged]
        self.purged = purged

    def test_reported_and_left_unchanged(self) -> None:
        for compress in (compress_levels, compress_smart):
            plan = compress(self.groups)
            self.assertTrue(plan.missing)
            self.assertEqual(set(plan.missing.values()), self.purged)
            by_id = {g.group_id: g for g in self.groups}
            for group_id in plan.missing:
                entry = next(e for e in plan.entries if e.group_id == group_id)
                self.assertFalse(entry.changed)
                self.assertEqual(entry.delta, by_id[group_id].delta)
            self.assertEqual(verify(self.groups, plan), [])
            depths = chain_depths(plan.entries)
            resolved = [g for g in depths if g not in plan.missing]
            self.assertLessEqual(max(depths[g] for g in resolved), 172)


class ChunkTests(TestCase):
    def test_chunks_match_one_shot_and_stay_bounded(self) -> None:
        groups = persisted_room(1500, seed=4, fork_rate=0.1)
        states = full_states(groups)
        for strategy, one_shot in (("levels", compress_levels), ("smart", compress_smart)):
            whole = one_shot(groups, window=8)
            for size in (1, 37, 500):
                compactor = StreamingCompactor(strategy, window=8, resolve_state=states.get)
                entries = []
                for chunk in chunked(groups, size):
                    entries.extend(compactor.feed(chunk).entries)
                    self.assertLessEqual(
                        len(compactor.carried_groups),
                        8 + len(DEFAULT_LEVELS) + DEFAULT_RETIRED * (len(DEFAULT_LEVELS) - 1),
                    )
                self.assertEqual(tuple(entries), whole.entries, (strategy, size))
                self.assertEqual(compactor.rows_after, whole.rows_after)
                self.assertEqual(compactor.max_depth, whole.max_depth)

    def test_chunks_without_resolver_skip_but_stay_correct(self) -> None:
        groups = persisted_room(1500, seed=4, fork_rate=0.1)
        plans = list(compress_chunks(chunked(groups, 50), "smart", window=2))
        entries = [e for p in plans for e in p.entries]
        self.assertEqual(verify(groups, entries), [])
        missing = {g for p in plans for g in p.missing}
        self.assertTrue(missing)  # forks reaching back past the window and chunk
        self.assertLessEqual(max_hops(entries), 172)

    def test_out_of_order_feed_is_rejected(self) -> None:
        compactor = StreamingCompactor()
        compactor.feed(chain({1: 1}, {2: 2}, start=5))
        with self.assertRaises(ValueError):
            compactor.feed(chain({1: 1}, start=6))
        with self.assertRaises(ValueError):
            compactor.feed([E(9, None, {}), E(8, None, {})])

    def test_should_apply_uses_room_totals(self) -> None:
        groups = persisted_room(1000, seed=6, keys=3000)
        compactor = StreamingCompactor()
        for chunk in chunked(groups, 128):
            compactor.feed(chunk)
        self.assertEqual(compactor.rows_before, count_rows(groups))
        self.assertTrue(compactor.should_apply(1000))
        self.assertFalse(compactor.should_apply(compactor.saving + 1))


class CompressRoomTests(TestCase):
    def test_auto_picks_the_smaller_plan_and_applying_it_is_safe(self) -> None:
        groups = persisted_room(2000, seed=2, fork_rate=0.2)
        result = compress_room(groups)
        self.assertEqual(result.action, "rewrite")
        self.assertEqual(result.strategy, "smart")
        after = apply_plan(groups, result.writes)
        self.assertEqual(verify(groups, after), [])
        self.assertEqual(count_rows(after), result.rows_after)
        self.assertLess(result.rows_after, result.rows_before)
        self.assertLessEqual(max_hops(after), 172)

    def test_skip_when_saving_too_small(self) -> None:
        groups = persisted_room(500, seed=2, keys=3000)
        result = compress_room(groups, "levels", min_saving=10**9)
        self.assertEqual(result.action, "skip")
        self.assertEqual(result.writes, ())
        self.assertGreater(result.saving, 0)

    def test_skip_when_already_compacted(self) -> None:
        groups = persisted_room(500, seed=2)
        first = compress_room(groups, min_saving=0)
        again = compress_room(apply_plan(groups, first.writes), min_saving=0)
        self.assertEqual(again.action, "skip")

    def test_skip_rather_than_grow(self) -> None:
        # A chain of small deltas that levels would rebase onto bigger ones.
        groups = [E(1, None, {0: 0})] + [E(i, 1, {i: i}) for i in range(2, 40)]
        result = compress_room(groups, "levels", levels=(3,), min_saving=0)
        self.assertGreater(result.rows_after, result.rows_before)
        self.assertEqual(result.action, "skip")

    def test_empty_room(self) -> None:
        result = compress_room([])
        self.assertEqual((result.action, result.rows_before, result.rows_after), ("skip", 0, 0))


class PackageTests(TestCase):
    def test_import_does_not_pull_in_pyspark(self) -> None:
        code = "import sys, roomstore.compaction; print('pyspark' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "False")


class NoRemovalsTests(TestCase):
    """``allow_removals=False`` (Synapse's layout, whose deltas cannot remove a key)."""

    def test_sibling_with_an_extra_key_is_not_a_base(self) -> None:
        # 3 adds key 9 on top of 2; 4 forks from 2 without key 9. With
        # removals, 4 may hang off 3 with a tombstone; without, it must not.
        groups = [E(1, None, {1: 1, 2: 2}), E(2, 1, {3: 3}), E(3, 2, {9: 9}), E(4, 2, {})]
        for strategy in ("levels", "smart"):
            plan = StreamingCompactor(strategy, levels=(3, 2), allow_removals=False).feed(groups)
            by_id = {e.group_id: e for e in plan.entries}
            self.assertNotEqual(by_id[4].prev_group, 3, strategy)
            self.assertEqual(verify(groups, apply_plan(groups, [e for e in plan.entries if e.changed])), [], strategy)

    def test_forked_rooms_compact_without_removals_and_verify(self) -> None:
        for seed in range(6):
            groups = persisted_room(700, seed=seed, removal_rate=0.0, fork_rate=0.1, keys=80)
            for strategy in ("levels", "smart"):
                with_removals = StreamingCompactor(strategy).feed(groups)
                plan = StreamingCompactor(strategy, allow_removals=False).feed(groups)
                writes = [e for e in plan.entries if e.changed]
                self.assertTrue(writes, (seed, strategy))
                self.assertFalse(
                    [e.group_id for e in plan.entries for v in e.delta.values() if v is None], (seed, strategy)
                )
                after = apply_plan(groups, writes)
                self.assertEqual(verify(groups, after), [], (seed, strategy))
                self.assertLessEqual(max_hops(after), levels_hop_bound(DEFAULT_LEVELS))
                if strategy == "smart":
                    # (levels ignores forks: on this room it stores more than persisted)
                    self.assertLess(plan.rows_after, count_rows(groups), seed)
                    # The constraint costs few rows (greedy choices may even gain some).
                    self.assertLessEqual(plan.rows_after, with_removals.rows_after * 1.1, seed)

    def test_past_heads_spare_snapshots_in_rooms_that_keep_gaining_keys(self) -> None:
        # New keys keep arriving (new members), so a fork's other branch holds
        # a key this group lacks: when that branch's group is the level head,
        # the levels base needs a removal. Kept past heads of the upper levels
        # (an older, smaller state) give a delta where none used to mean a
        # snapshot of the whole state.
        for seed, fork_rate in ((1, 0.05), (2, 0.1), (3, 0.2)):
            groups = persisted_room(4000, seed=seed, keys=5000, fork_rate=fork_rate, removal_rate=0.0)
            without = StreamingCompactor("smart", allow_removals=False, retired=0).feed(groups)
            plan = StreamingCompactor("smart", allow_removals=False).feed(groups)
            self.assertLess(plan.rows_after, without.rows_after * 0.8, seed)
            self.assertFalse([e.group_id for e in plan.entries for v in e.delta.values() if v is None], seed)
            after = apply_plan(groups, [e for e in plan.entries if e.changed])
            self.assertEqual(verify(groups, after), [], seed)
            self.assertLessEqual(max_hops(after), levels_hop_bound(DEFAULT_LEVELS), seed)

    def test_removal_counts_follow_the_anchor(self) -> None:
        # The compactor's per-candidate count of keys the anchor lacks (what
        # makes a base need a removal) equals a recount from the diffs at every
        # step, with removals and forks in the history.
        checked = []

        class Recounting(StreamingCompactor):
            def _best_base(self, group_id, orig_prev, budget):
                for cand, diff in self._diffs.items():
                    self.assertEqual(sum(1 for k in diff if k not in self._anchor), self._absent[cand])
                checked.append(group_id)
                return super()._best_base(group_id, orig_prev, budget)

        for seed in range(3):
            groups = persisted_room(600, seed=seed, keys=40, fork_rate=0.2, removal_rate=0.2)
            for strategy in ("levels", "smart"):
                compactor = Recounting(strategy, levels=(5, 3, 2), window=4, allow_removals=False)
                compactor.assertEqual = self.assertEqual
                plan = compactor.feed(groups)
                after = apply_plan(groups, [e for e in plan.entries if e.changed])
                self.assertEqual(verify(groups, after), [], (seed, strategy))
        self.assertGreater(len(checked), 1000)
