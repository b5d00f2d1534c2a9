"""State: state groups stored as deltas with bounded chains.

Public face: ``StateGroupStore`` (``create``, ``get_state``,
``get_state_filtered``), ``StateGroupWrites`` (a transaction's new groups,
written together), ``StateGroupNotFound``, ``DEFAULT_MAX_CHAIN_LENGTH``,
and ``merge_states`` / ``ConflictedStateError`` for deriving the state where
several prev events meet.
"""

from roomstore.state.groups import (
    DEFAULT_MAX_CHAIN_LENGTH,
    NewStateGroup,
    StateGroupNotFound,
    StateGroupStore,
    StateGroupWrites,
)
from roomstore.state.merge import ConflictedStateError, merge_states

__all__ = [
    "ConflictedStateError",
    "DEFAULT_MAX_CHAIN_LENGTH",
    "NewStateGroup",
    "StateGroupNotFound",
    "StateGroupStore",
    "StateGroupWrites",
    "merge_states",
]
