"""Merging the states of several prev events, without state resolution.

Where prev events' states agree, or differ only in keys that are present in
some and absent in others, the union is the state. Where one key has
different events in different branches the merge is *conflicted*: resolving
that needs the room version's state resolution algorithm, which is the
homeserver's business, so the store refuses and names the keys.
"""

from __future__ import annotations

from typing import Mapping, Sequence


class ConflictedStateError(ValueError):
    """Several prev events' states disagree on some keys.

    ``conflicts`` maps each conflicting key (as given: interned ids inside the
    store, ``(type, state_key)`` at its edge) to the set of candidate events.
    """

    def __init__(self, message: str, conflicts: Mapping):
        super().__init__(message)
        self.conflicts = dict(conflicts)


def find_conflicts(states: Sequence[Mapping]) -> dict:
    """Keys with more than one distinct value among ``states``."""
    seen: dict = {}
    conflicts: dict = {}
    for state in states:
        for key, value in state.items():
            first = seen.setdefault(key, value)
            if first != value:
                conflicts.setdefault(key, {first}).add(value)
    return conflicts


def merge_states(states: Sequence[Mapping]) -> tuple[int, dict]:
    """Union of ``states``; returns (index of the best base, merged state).

    The base is the input with most keys, so a delta against it is smallest.
    Raises ``ConflictedStateError`` (keys as given) when any key disagrees.
    """
    if not states:
        return -1, {}
    conflicts = find_conflicts(states)
    if conflicts:
        raise ConflictedStateError(f"conflicting state for {len(conflicts)} keys", conflicts)
    base = max(range(len(states)), key=lambda i: len(states[i]))
    merged = dict(states[base])
    for state in states:
        for key, value in state.items():
            merged.setdefault(key, value)
    return base, merged
