"""State: state groups stored as deltas with bounded chains.

Public face: ``StateGroupStore`` (``create``, ``get_state``,
``get_state_filtered``), ``StateGroupWrites`` (a transaction's new groups,
written together), ``StateGroupNotFound``, ``DEFAULT_MAX_CHAIN_LENGTH``;
``apply_delta`` / ``state_diff`` between a state and a delta. Where several
prev events' states meet, ``roomstore.resolution`` resolves them.
"""

import importlib

# Names resolved on first use (PEP 562), not at package import: the compaction
# job's executors import roomstore.state.deltas with none of the store's
# dependencies (Twisted, prometheus_client) installed, and importing a
# submodule runs this file first.
_HOME = {
    "DEFAULT_MAX_CHAIN_LENGTH": "roomstore.state.groups",
    "NewStateGroup": "roomstore.state.groups",
    "StateGroupNotFound": "roomstore.state.groups",
    "StateGroupStore": "roomstore.state.groups",
    "StateGroupWrites": "roomstore.state.groups",
    "apply_delta": "roomstore.state.deltas",
    "state_diff": "roomstore.state.deltas",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'roomstore.state' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = sorted(_HOME)
