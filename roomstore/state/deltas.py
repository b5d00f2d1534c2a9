"""A state as a delta on another, and back: the one definition of both.

A state maps ``(type, state_key)`` nids to event nids; a delta maps keys to
an event nid (set) or None (removed). The event persister derives new
groups' deltas with ``state_diff``; the compaction job (above the store)
uses both to rebuild and re-delta groups.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["apply_delta", "state_diff"]

State = dict[int, int]
Delta = Mapping[int, int | None]


def apply_delta(state: State, delta: Delta) -> State:
    """Apply ``delta`` to ``state`` in place and return it.

    Keys mapped to ``None`` are removed (a no-op if absent), others are set.
    """
    for key, value in delta.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    return state


def state_diff(state: Mapping[int, int], base: Mapping[int, int]) -> dict[int, int | None]:
    """``state`` as a delta on ``base`` (None: a key of ``base`` absent from
    ``state``): ``apply_delta(dict(base), state_diff(state, base)) == state``."""
    diff: dict[int, int | None] = {k: v for k, v in state.items() if base.get(k) != v}
    for key in base:
        if key not in state:
            diff[key] = None
    return diff
