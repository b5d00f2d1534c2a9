"""Check an import against the Synapse database it came from.

For every event of the selected rooms that the store holds and Synapse gave
a state group (outliers have none): the store's state after the event equals
the full state of that group; and for every such event, the store's
redaction flag equals whether Synapse serves it redacted. Events Synapse has
and the store lacks are counted (``not_imported``), not compared.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from roomstore.synapse_db.reader import SynapseReader
from roomstore.synapse_db.source import StateMap, SynapseSource

#: Full states of Synapse's groups kept between events (consecutive events
#: mostly share a group): bounded, so memory stays flat.
_GROUP_CACHE = 256


@attrs.define
class VerifySummary:
    """What one ``verify-synapse`` run found (its JSON summary line)."""

    rooms: int = 0
    events_checked: int = 0
    states_compared: int = 0
    not_imported: int = 0
    state_differences: int = 0
    redaction_differences: int = 0

    @property
    def differences(self) -> int:
        return self.state_differences + self.redaction_differences

    def as_json(self) -> dict:
        return {**attrs.asdict(self), "differences": self.differences}


class _Groups:
    """Synapse group states, a bounded LRU in front of the source."""

    def __init__(self, source: SynapseSource):
        self.source = source
        self._cache: collections.OrderedDict[int, StateMap] = collections.OrderedDict()

    def states(self, groups: Sequence[int]) -> dict[int, StateMap]:
        found = {}
        for group in groups:
            state = self._cache.get(group)
            if state is None:
                state = self.source.group_state(group)
                self._cache[group] = state
                if len(self._cache) > _GROUP_CACHE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(group)
            found[group] = state
        return found


def _synapse_facts(source: SynapseSource, groups: _Groups, event_ids: list[str]):
    """(state after each event with a group, the redacted ones) from Synapse."""
    of_event = source.state_groups_of(event_ids)
    states = groups.states(sorted(set(of_event.values())))
    return {e: states[g] for e, g in of_event.items()}, source.redacted_events(event_ids)


async def verify_synapse(
    store: Any,
    reader: SynapseReader,
    rooms: Sequence[str] | None = None,
    page_size: int = 500,
    report: Callable[[dict], None] | None = None,
    max_reported: int = 20,
) -> VerifySummary:
    """Compare ``store`` with Synapse's database; ``report`` receives the first
    ``max_reported`` differences, one dict each."""
    source = reader.source
    summary = VerifySummary()
    room_list = await reader.run(source.room_ids, rooms)
    summary.rooms = len(room_list)
    if rooms is not None and not room_list:
        return summary
    selection = None if rooms is None else room_list
    groups = _Groups(source)
    reported = 0

    def differ(item: dict) -> None:
        nonlocal reported
        if report is not None and reported < max_reported:
            report(item)
        reported += 1

    after = None
    while True:
        page = await reader.run(source.events_page, after, page_size, selection)
        if not page:
            break
        after = page[-1].stream_ordering
        ids = [ev.event_id for ev in page]
        flags = await store.get_event_flags(ids)
        summary.not_imported += len(ids) - len(flags)
        held = [e for e in ids if e in flags]
        states, redacted = await reader.run(_synapse_facts, source, groups, held)
        for event_id in held:
            summary.events_checked += 1
            if flags[event_id].redacted != (event_id in redacted):
                summary.redaction_differences += 1
                differ(
                    {
                        "event_id": event_id,
                        "difference": "redaction",
                        "synapse_redacted": event_id in redacted,
                        "roomstore_redacted": flags[event_id].redacted,
                    }
                )
            theirs = states.get(event_id)
            if theirs is None or flags[event_id].outlier:
                continue
            ours = await store.get_state_ids(event_id)
            summary.states_compared += 1
            if ours != theirs:
                summary.state_differences += 1
                keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
                differ(
                    {
                        "event_id": event_id,
                        "difference": "state",
                        "keys": [
                            {"type": t, "state_key": k, "synapse": theirs.get((t, k)), "roomstore": ours.get((t, k))}
                            for t, k in keys[:10]
                        ],
                    }
                )
    return summary
