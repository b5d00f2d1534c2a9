"""Which entities changed since a stream position, answered from memory.

A ``StreamChangeCache`` remembers, for recent stream positions, which entities
(rooms, users, ...) changed there. Below its *earliest known position* it
cannot tell, and says so, sending the caller to the database. Its size is
bounded: when it is full the oldest positions are forgotten and the earliest
known position moves up past them.

Who calls it: the store's writers on commit (``entity_has_changed``, through
``txn.call_after``) and replication on RDATA; readers before querying.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Hashable, Iterable

from prometheus_client import Counter

cache_lookups = Counter(
    "roomstore_change_cache_lookups",
    "Stream change cache answers: known (from memory) or unknown (caller must ask the database)",
    ["cache", "answer"],
)


class StreamChangeCache:
    """Tracks the newest change position of recently changed entities.

    ``earliest_known_position``: every change after it is in the cache
    (the store passes its stream position at start-up).
    """

    def __init__(
        self,
        name: str,
        earliest_known_position: int,
        max_size: int = 10_000,
        prefilled: Iterable[tuple[Hashable, int]] = (),
    ):
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.name = name
        self.max_size = max_size
        self._earliest_known = earliest_known_position
        self._entity_to_pos: dict[Hashable, int] = {}
        # Sorted positions, and the entities whose newest change is there.
        self._positions: list[int] = []
        self._pos_to_entities: dict[int, set[Hashable]] = {}
        for entity, pos in prefilled:
            self.entity_has_changed(entity, pos)

    @property
    def earliest_known_position(self) -> int:
        return self._earliest_known

    def __len__(self) -> int:
        return len(self._entity_to_pos)

    # ------------------------------------------------------------------ writes

    def entity_has_changed(self, entity: Hashable, position: int) -> None:
        """Record that ``entity`` changed at ``position``."""
        if position <= self._earliest_known:
            return  # already covered by "don't know"
        old = self._entity_to_pos.get(entity)
        if old is not None:
            if old >= position:
                return
            self._remove(entity, old)
        self._entity_to_pos[entity] = position
        bucket = self._pos_to_entities.get(position)
        if bucket is None:
            self._pos_to_entities[position] = {entity}
            if not self._positions or position > self._positions[-1]:
                self._positions.append(position)  # the common case: positions grow
            else:
                bisect.insort(self._positions, position)
        else:
            bucket.add(entity)
        self._evict()

    def _remove(self, entity: Hashable, position: int) -> None:
        bucket = self._pos_to_entities[position]
        bucket.discard(entity)
        if not bucket:
            del self._pos_to_entities[position]
            index = bisect.bisect_left(self._positions, position)
            del self._positions[index]

    def _evict(self) -> None:
        while len(self._entity_to_pos) > self.max_size:
            oldest = self._positions.pop(0)
            for entity in self._pos_to_entities.pop(oldest):
                del self._entity_to_pos[entity]
            self._earliest_known = max(self._earliest_known, oldest)

    # ------------------------------------------------------------------ reads

    def knows_since(self, position: int) -> bool:
        """True if every change after ``position`` is in the cache."""
        return position >= self._earliest_known

    def has_entity_changed(self, entity: Hashable, since: int) -> bool:
        """False only when ``entity`` certainly has not changed after ``since``.

        True means changed, or not known (``since`` is below the earliest
        known position): either way the caller must look.
        """
        if not self.knows_since(since):
            cache_lookups.labels(self.name, "unknown").inc()
            return True
        cache_lookups.labels(self.name, "known").inc()
        pos = self._entity_to_pos.get(entity)
        return pos is not None and pos > since

    def get_entities_changed(self, entities: Collection[Hashable], since: int) -> set[Hashable] | None:
        """The subset of ``entities`` that changed after ``since``, or None if unknown."""
        if not self.knows_since(since):
            cache_lookups.labels(self.name, "unknown").inc()
            return None
        cache_lookups.labels(self.name, "known").inc()
        # Walk whichever side is smaller: the entities asked about or the recent changes.
        start = bisect.bisect_right(self._positions, since)
        changed_count = len(self._positions) - start
        if len(entities) <= changed_count:
            return {e for e in entities if self._entity_to_pos.get(e, since) > since}
        wanted = entities if isinstance(entities, (set, frozenset)) else set(entities)
        result: set[Hashable] = set()
        for pos in self._positions[start:]:
            result.update(e for e in self._pos_to_entities[pos] if e in wanted)
        return result

    def get_all_entities_changed(self, since: int) -> list[Hashable] | None:
        """Every entity changed after ``since``, oldest change first; None if unknown."""
        if not self.knows_since(since):
            return None
        start = bisect.bisect_right(self._positions, since)
        result: list[Hashable] = []
        for pos in self._positions[start:]:
            result.extend(self._pos_to_entities[pos])
        return result

    def has_any_entity_changed(self, since: int) -> bool:
        """False only when nothing at all changed after ``since`` (and that is known)."""
        if not self.knows_since(since):
            return True
        return bool(self._positions) and self._positions[-1] > since

    def get_max_pos_of_last_change(self, entity: Hashable) -> int:
        """The newest change position of ``entity``, or the earliest known position."""
        return self._entity_to_pos.get(entity, self._earliest_known)
