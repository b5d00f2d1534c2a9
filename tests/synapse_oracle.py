"""matrix-synapse as a test and benchmark oracle, beside our own dependencies.

Synapse checks its dependency pins the first time ``synapse.app`` is imported
(which its replication and storage modules do indirectly) and exits the
process when one is off. Its pin on txredisapi (``<1.6``, for Synapse's own
Redis client) excludes the 1.6 that roomstore's Redis transport uses. None of
what we call as an oracle (the command and row parsers, the client protocol
class, the state-fetching function) touches txredisapi, so the pin check is
turned off before Synapse is imported; nothing else of Synapse is changed.
"""

from __future__ import annotations


def prepare_synapse() -> bool:
    """Make Synapse importable here; False when it is not installed."""
    try:
        from synapse.util import check_dependencies
    except ImportError:
        return False
    check_dependencies.check_requirements = _no_check
    return True


def _no_check(extra: str | None = None) -> None:
    """Synapse's pin check, skipped (see the module docstring)."""
