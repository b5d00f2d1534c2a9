"""Streams: ID generators with reserve/complete semantics, and change caches.

Public face: ``StreamIdGenerator`` (``create``, ``get_next``, ``get_next_mult``,
``get_current_token``, ``get_current_token_for_writer``, ``get_max_token``,
``get_positions``, ``advance``, ``wait_for_position``, ``position_after``,
``persist_position_txn``), ``reserve_together`` (several streams at once), ``reserve_in_transaction``
(IDs taken inside the caller's transaction, counted there), ``BackingTable``,
``StreamChangeCache``, and the errors ``StreamConfigError``, ``SequenceLagError``.
"""

from roomstore.streams.change_cache import StreamChangeCache
from roomstore.streams.id_generators import (
    BackingTable,
    SequenceLagError,
    StreamConfigError,
    StreamIdGenerator,
)
from roomstore.streams.reservations import reserve_in_transaction, reserve_together

__all__ = [
    "BackingTable",
    "SequenceLagError",
    "StreamChangeCache",
    "StreamConfigError",
    "StreamIdGenerator",
    "reserve_in_transaction",
    "reserve_together",
]
