"""Property tests: random forests, every strategy, chunked and not."""

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from roomstore.compaction import (
    DEFAULT_RETIRED,
    StateGroupEntry,
    StreamingCompactor,
    chain_depths,
    compress_levels,
    compress_room,
    compress_smart,
    count_rows,
    full_states_partial,
    levels_hop_bound,
    verify,
)
from tests.compaction._builders import apply_plan, chunked, persisted_room

# database=None: keep the example database out of the working tree.
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, database=None)

deltas = st.dictionaries(st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40)), max_size=6)


@st.composite
def forests(draw) -> list[StateGroupEntry]:
    """Groups with sparse ascending ids, predecessors among recent earlier
    groups (or none), tombstones, and some groups purged afterwards."""
    count = draw(st.integers(1, 70))
    ids = sorted(draw(st.sets(st.integers(1, 10_000), min_size=count, max_size=count)))
    groups = []
    for index, group_id in enumerate(ids):
        prev: int | None = None
        if index and draw(st.integers(0, 9)):  # mostly deltas
            prev = ids[draw(st.integers(max(0, index - 12), index - 1))]
        groups.append(StateGroupEntry(group_id, prev, draw(deltas)))
    purged = draw(st.sets(st.sampled_from(ids), max_size=2)) if draw(st.booleans()) else set()
    return [g for g in groups if g.group_id not in purged]


configs = st.fixed_dictionaries(
    {
        "levels": st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
        "window": st.integers(1, 10),
        "extra_hops": st.integers(-3, 5),
    }
)


def resolved_depths(plan) -> dict[int, int]:
    depths = chain_depths(plan.entries)
    return {g: d for g, d in depths.items() if g not in plan.missing}


class RandomForestTests(TestCase):
    @PROPERTY_SETTINGS
    @given(forests(), configs)
    def test_states_preserved_and_hops_bounded(self, groups, config) -> None:
        levels, window = config["levels"], config["window"]
        bound = levels_hop_bound(levels)
        limit = max(0, bound + config["extra_hops"])
        expected_missing = set(full_states_partial(groups).missing)

        lv = compress_levels(groups, levels, window=window)
        self.assertEqual(verify(groups, lv), [])
        self.assertEqual(set(lv.missing), expected_missing)
        self.assertLessEqual(max(resolved_depths(lv).values(), default=0), bound)

        sm = compress_smart(groups, limit, window, levels=levels)
        self.assertEqual(verify(groups, sm), [])
        self.assertEqual(set(sm.missing), expected_missing)
        self.assertLessEqual(max(resolved_depths(sm).values(), default=0), limit)
        self.assertEqual(sm.max_depth, max(resolved_depths(sm).values(), default=0))
        if limit >= bound:
            for a, b in zip(lv.entries, sm.entries, strict=True):
                self.assertLessEqual(len(b.delta), len(a.delta))

    @PROPERTY_SETTINGS
    @given(forests(), configs, st.sampled_from(["auto", "levels", "smart"]))
    def test_compress_room_never_grows(self, groups, config, strategy) -> None:
        levels = config["levels"]
        result = compress_room(groups, strategy, levels=levels, window=config["window"], min_saving=0)
        if result.action == "skip":
            self.assertTrue(result.saving < 0 or not result.plan.changed_entries)
            return
        after = apply_plan(groups, result.writes)
        self.assertLessEqual(count_rows(after), count_rows(groups))
        self.assertEqual(count_rows(after), result.rows_after)
        self.assertEqual(verify(groups, after), [])

    @PROPERTY_SETTINGS
    @given(forests(), configs, st.integers(1, 20), st.sampled_from(["levels", "smart"]))
    def test_chunked_equals_one_shot(self, groups, config, size, strategy) -> None:
        levels, window = config["levels"], config["window"]
        one_shot = StreamingCompactor(strategy, levels=levels, window=window).feed(groups)
        states = full_states_partial(groups).states

        with_lookup = StreamingCompactor(strategy, levels=levels, window=window, resolve_state=states.get)
        entries = []
        missing = set()
        for chunk in chunked(groups, size):
            plan = with_lookup.feed(chunk)
            entries.extend(plan.entries)
            missing.update(plan.missing)
            self.assertLessEqual(
                len(with_lookup.carried_groups), window + len(levels) + DEFAULT_RETIRED * (len(levels) - 1)
            )
        self.assertEqual(tuple(entries), one_shot.entries)
        self.assertEqual(missing, set(one_shot.missing))

        without = StreamingCompactor(strategy, levels=levels, window=window)
        entries = [e for c in chunked(groups, size) for e in without.feed(c).entries]
        self.assertEqual(verify(groups, entries), [])


class SeededRoomTests(TestCase):
    """Bigger persist-style rooms, a few fixed seeds."""

    def test_persisted_rooms(self) -> None:
        for seed in range(4):
            groups = persisted_room(3000, seed=seed, keys=1500, fork_rate=0.08)
            states = full_states_partial(groups).states
            for strategy in ("levels", "smart"):
                whole = StreamingCompactor(strategy).feed(groups)
                self.assertEqual(verify(groups, whole), [])
                self.assertLessEqual(whole.max_depth, 172)
                self.assertLess(whole.rows_after, whole.rows_before)
                chunks = StreamingCompactor(strategy, resolve_state=states.get)
                entries = [e for c in chunked(groups, 256) for e in chunks.feed(c).entries]
                self.assertEqual(tuple(entries), whole.entries)
