"""Offline state-group compaction.

The pure-Python algorithm lives here (no Spark, no database); the Spark job
drives :class:`StreamingCompactor` once per room. Importing this package never
imports pyspark.

Typical use::

    from roomstore.compaction import compress_room, verify

    result = compress_room(groups, strategy="auto", min_saving=1000)
    if result.action == "rewrite":
        assert not verify(groups, result.plan)
        write(result.writes)
"""

from roomstore.compaction.algorithm import (
    DEFAULT_LEVELS,
    DEFAULT_RETIRED,
    DEFAULT_WINDOW,
    RoomCompaction,
    StreamingCompactor,
    compress_chunks,
    compress_levels,
    compress_room,
    compress_smart,
    levels_hop_bound,
)
from roomstore.compaction.model import (
    CompactionPlan,
    MissingPredecessorError,
    PlanEntry,
    PredecessorCycleError,
    StateGroupEntry,
    StateResolutionError,
    count_rows,
)
from roomstore.compaction.states import (
    PartialStates,
    chain_depths,
    full_states,
    full_states_partial,
    max_hops,
    verify,
)

__all__ = [
    "DEFAULT_LEVELS",
    "DEFAULT_RETIRED",
    "DEFAULT_WINDOW",
    "CompactionPlan",
    "MissingPredecessorError",
    "PartialStates",
    "PlanEntry",
    "PredecessorCycleError",
    "RoomCompaction",
    "StateGroupEntry",
    "StateResolutionError",
    "StreamingCompactor",
    "chain_depths",
    "compress_chunks",
    "compress_levels",
    "compress_room",
    "compress_smart",
    "count_rows",
    "full_states",
    "full_states_partial",
    "levels_hop_bound",
    "max_hops",
    "verify",
]
