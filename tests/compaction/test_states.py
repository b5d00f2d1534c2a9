"""Tests for full-state computation, chain depths and plan verification."""

from twisted.trial.unittest import TestCase

from roomstore.compaction import (
    MissingPredecessorError,
    PlanEntry,
    PredecessorCycleError,
    StateGroupEntry,
    chain_depths,
    count_rows,
    full_states,
    full_states_partial,
    max_hops,
    verify,
)
from roomstore.compaction.states import apply_delta, state_diff
from tests.compaction._builders import chain, persisted_room

E = StateGroupEntry


class FullStatesTests(TestCase):
    def test_linear_chain(self) -> None:
        groups = chain({1: 10, 2: 20}, {3: 30}, {1: 11})
        self.assertEqual(
            full_states(groups),
            {
                1: {1: 10, 2: 20},
                2: {1: 10, 2: 20, 3: 30},
                3: {1: 11, 2: 20, 3: 30},
            },
        )

    def test_state_diff_is_what_apply_delta_undoes(self) -> None:
        base = {1: 10, 2: 20, 3: 30}
        state = {1: 10, 2: 21, 4: 40}
        diff = state_diff(state, base)
        self.assertEqual(diff, {2: 21, 4: 40, 3: None})
        self.assertEqual(apply_delta(dict(base), diff), state)
        self.assertEqual(state_diff(base, base), {})

    def test_tombstones_remove_keys(self) -> None:
        groups = chain({1: 10, 2: 20}, {2: None, 3: 30}, {2: 21})
        states = full_states(groups)
        self.assertEqual(states[2], {1: 10, 3: 30})
        self.assertEqual(states[3], {1: 10, 2: 21, 3: 30})

    def test_tombstone_in_snapshot_or_for_absent_key_is_a_no_op(self) -> None:
        groups = [E(1, None, {1: 10, 9: None}), E(2, 1, {8: None})]
        self.assertEqual(full_states(groups), {1: {1: 10}, 2: {1: 10}})

    def test_forks_and_snapshots(self) -> None:
        groups = [
            E(1, None, {1: 10}),
            E(2, 1, {2: 20}),
            E(3, 1, {2: 21}),  # fork off 1
            E(4, None, {5: 50}),  # second tree
            E(5, 3, {1: None}),
        ]
        states = full_states(groups)
        self.assertEqual(states[2], {1: 10, 2: 20})
        self.assertEqual(states[3], {1: 10, 2: 21})
        self.assertEqual(states[4], {5: 50})
        self.assertEqual(states[5], {2: 21})

    def test_input_order_and_tuples_do_not_matter(self) -> None:
        groups = chain({1: 10}, {2: 20}, {3: 30})
        tuples = [(g.group_id, g.prev_group, g.delta) for g in reversed(groups)]
        self.assertEqual(full_states(tuples), full_states(groups))

    def test_states_are_independent_copies(self) -> None:
        states = full_states(chain({1: 10}, {2: 20}))
        states[1][7] = 70
        self.assertNotIn(7, states[2])

    def test_deep_chain_has_no_recursion_limit(self) -> None:
        groups = [E(1, None, {0: 0})] + [E(i, i - 1, {i % 50: i}) for i in range(2, 20_001)]
        states = full_states(groups)
        self.assertEqual(states[20_000][0], 20_000)
        self.assertEqual(states[20_000][1], 19_951)
        self.assertEqual(max_hops(groups), 19_999)

    def test_missing_predecessor_raises_clearly(self) -> None:
        groups = [E(1, None, {1: 10}), E(3, 2, {2: 20}), E(4, 3, {})]
        with self.assertRaises(MissingPredecessorError) as caught:
            full_states(groups)
        self.assertEqual(caught.exception.missing_group, 2)
        self.assertIn("state group 2", str(caught.exception))

    def test_cycle_raises_clearly(self) -> None:
        groups = [E(1, 3, {}), E(2, 1, {}), E(3, 2, {}), E(4, None, {})]
        with self.assertRaises(PredecessorCycleError) as caught:
            full_states(groups)
        self.assertEqual(set(caught.exception.cycle), {1, 2, 3})
        with self.assertRaises(PredecessorCycleError):
            full_states_partial(groups)
        with self.assertRaises(PredecessorCycleError):
            chain_depths(groups)

    def test_partial_reports_missing_transitively(self) -> None:
        groups = [E(1, None, {1: 10}), E(3, 2, {2: 20}), E(4, 3, {}), E(5, 1, {5: 50})]
        result = full_states_partial(groups)
        self.assertEqual(result.missing, {3: 2, 4: 2})
        self.assertEqual(result.states, {1: {1: 10}, 5: {1: 10, 5: 50}})


class DepthTests(TestCase):
    def test_depths(self) -> None:
        groups = [E(1, None, {}), E(2, 1, {}), E(3, 2, {}), E(4, 1, {}), E(5, None, {})]
        self.assertEqual(chain_depths(groups), {1: 0, 2: 1, 3: 2, 4: 1, 5: 0})
        self.assertEqual(max_hops(groups), 2)
        self.assertEqual(max_hops([]), 0)

    def test_dangling_link_counts_one_hop(self) -> None:
        self.assertEqual(chain_depths([E(5, 4, {}), E(6, 5, {})]), {5: 1, 6: 2})

    def test_count_rows_includes_tombstones(self) -> None:
        self.assertEqual(count_rows(chain({1: 1, 2: 2}, {1: None}, {})), 3)


class VerifyTests(TestCase):
    def setUp(self) -> None:
        self.groups = chain({1: 10, 2: 20}, {3: 30}, {2: None}, {1: 11})

    def test_identity_plan_passes(self) -> None:
        self.assertEqual(verify(self.groups, self.groups), [])

    def test_equivalent_rewrite_passes(self) -> None:
        # Group 4 rebased onto the snapshot: needs the tombstone for key 2.
        rewritten = list(self.groups)
        rewritten[3] = PlanEntry(4, 1, {1: 11, 2: None, 3: 30}, True)
        self.assertEqual(verify(self.groups, rewritten), [])

    def test_wrong_delta_is_reported_with_descendants(self) -> None:
        rewritten = list(self.groups)
        rewritten[1] = E(2, 1, {3: 31})
        self.assertEqual(verify(self.groups, rewritten), [2, 3, 4])

    def test_missing_tombstone_is_reported(self) -> None:
        rewritten = list(self.groups)
        rewritten[3] = E(4, 1, {1: 11, 3: 30})
        self.assertEqual(verify(self.groups, rewritten), [4])

    def test_missing_extra_and_dangling_groups_are_reported(self) -> None:
        rewritten = self.groups[:3] + [E(9, None, {})]
        self.assertEqual(verify(self.groups, rewritten), [4, 9])
        dangling = self.groups[:3] + [E(4, 7, {1: 11})]
        self.assertEqual(verify(self.groups, dangling), [4])

    def test_cyclic_plan_is_reported_not_raised(self) -> None:
        cyclic = [E(1, 3, {1: 10, 2: 20}), E(2, 1, {3: 30}), E(3, 2, {2: None})]
        cyclic.append(self.groups[3])
        self.assertEqual(verify(self.groups, cyclic), [1, 2, 3, 4])
        with self.assertRaises(PredecessorCycleError):
            verify(cyclic, self.groups)

    def test_unresolvable_original_must_stay_unchanged(self) -> None:
        groups = [E(1, None, {1: 10}), E(3, 2, {2: 20})]
        self.assertEqual(verify(groups, groups), [])
        self.assertEqual(verify(groups, [groups[0], E(3, 1, {2: 20})]), [3])

    def test_realistic_room(self) -> None:
        groups = persisted_room(1500, seed=3)
        self.assertEqual(verify(groups, groups), [])
        broken = list(groups)
        victim = broken[700]
        broken[700] = E(victim.group_id, victim.prev_group, {**victim.delta, 12345: 1})
        self.assertIn(victim.group_id, verify(groups, broken))
