"""Import a Synapse database's rooms into a ``RoomStore``.

Events go in Synapse's stream order, a page at a time (memory is bounded by
the page, whatever the database's size), each with the JSON Synapse stored,
byte for byte, its room's version, and Synapse's flags: outliers stay
outliers, rejected events keep their reason, backfilled events (negative
stream orderings) are stored as backfilled. Redactions are events like any
other: the store flags their targets itself.

roomstore does no state resolution, so where the DAG forks Synapse's answer
is taken: an event with several prev events is given the state before it from
Synapse's state groups, and a batch whose rooms' forward extremities conflict
is written again with Synapse's current state as of that batch as the
resolved current state.

Two pages are in the store's hands at once (the next validated while the one
before is written); which rooms a page leaves forked is followed in memory
from page to page (``_RoomEnds``), not read back after each write.

A rerun asks the store which events of each page it holds already and skips
them (counted as ``already_present``): nothing is stored twice and the
events stream does not move for them.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import orjson
from twisted.internet import defer

from roomstore import EVENT_REFUSALS, EventToPersist
from roomstore.synapse_db.reader import SynapseReader
from roomstore.synapse_db.source import StateMap, SynapseEvent, SynapseSource

Report = Callable[[dict], None]


@attrs.define
class ImportSummary:
    """What one ``import-synapse`` run did (its JSON summary line)."""

    rooms: int = 0
    events: int = 0
    already_present: int = 0
    outliers: int = 0
    rejected: int = 0
    backfilled: int = 0
    #: Events given the state before them from Synapse's state groups (forks).
    states_from_synapse: int = 0
    #: Batches written again with Synapse's current state, their rooms'
    #: forward extremities' states conflicting.
    current_states_from_synapse: int = 0
    #: Events whose content hash did not match: stored in their redacted
    #: form, each reported (as by ``roomstore import``).
    redacted_content_hash_mismatch: int = 0
    #: Reason (the store's error name) -> events skipped for it.
    skipped: dict[str, int] = attrs.field(factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict:
        return attrs.asdict(self)


async def import_synapse(
    store: Any,
    reader: SynapseReader,
    rooms: Sequence[str] | None = None,
    batch_size: int = 500,
    report: Report | None = None,
    progress: Any = None,
    trust_source: bool = False,
) -> ImportSummary:
    """Import ``rooms`` (default: every room) of the Synapse database behind
    ``reader`` into ``store``. ``report`` receives one dict per skipped event
    and per event the store's authorization checks rejected where Synapse
    had not; ``progress``, a bar, is updated per page. ``trust_source``:
    the events are stored as Synapse judged them, unchecked."""
    started = time.monotonic()
    source = reader.source
    summary = ImportSummary()
    room_list = await reader.run(source.room_ids, rooms)
    summary.rooms = len(room_list)
    selection = None if rooms is None else room_list
    if rooms is not None and not room_list:
        summary.seconds = round(time.monotonic() - started, 3)
        return summary
    # One page read ahead: Synapse's database is read while the store writes;
    # and ``PAGES_IN_FLIGHT`` pages handed to the store at once, so it
    # validates the next while it writes the one before.
    ends = _RoomEnds(store)
    report = report or (lambda item: None)
    pending: collections.deque[tuple[list[Any], Any]] = collections.deque()
    next_page = reader.run(source.events_page, None, batch_size, selection)
    # Events a run before this one stored are left out before they are
    # validated, looked for page by page until a page holds none: past what
    # an interrupted run stored, every page would only wait for the look (a
    # read, queued on SQLite's one database thread behind the writes in
    # flight, which would keep the next page's validation from overlapping
    # them). The store reports any stored event after that as present.
    look_for_stored = True
    try:
        while True:
            page: list[SynapseEvent] = await next_page
            if not page:
                break
            next_page = reader.run(source.events_page, page[-1].stream_ordering, batch_size, selection)
            present = await store.get_event_flags([ev.event_id for ev in page]) if look_for_stored else {}
            look_for_stored = bool(present)
            todo = [ev for ev in page if ev.event_id not in present]
            summary.already_present += len(page) - len(todo)
            if todo:
                pending.append(await _send_page(store, reader, todo, summary, ends, trust_source))
                if len(pending) >= PAGES_IN_FLIGHT:
                    await _settle_page(store, reader, *pending.popleft(), summary, report, ends)
            if progress is not None:
                progress.update(len(page))
        while pending:
            await _settle_page(store, reader, *pending.popleft(), summary, report, ends)
    finally:
        # An error stops the import: the pages in flight end before it is raised.
        for _, written in pending:
            try:
                await written
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


#: Pages handed to the store before the first is awaited.
PAGES_IN_FLIGHT = 4


class _RoomEnds:
    """Each room's forward extremities as the pages handed to the store leave
    them, so that a page's fork check (``forked_after``) need not wait for the
    write of the page before it. A room is read from the store the first time
    a page names it (no page in flight touches it then), then followed page
    by page as the store does: its live events' uncited ones replace the ends
    they cite. After a page the store refused in part (its events retried
    one by one), every room is read again."""

    def __init__(self, store: Any):
        self.store = store
        self.ends: dict[str, set[str]] = {}

    async def forked_after(self, events: Sequence[SynapseEvent]) -> set[str]:
        """The rooms left with several forward extremities after ``events``
        (outliers, rejected and backfilled events are no room's ends)."""
        live = [ev for ev in events if not ev.outlier and ev.rejected_reason is None and ev.stream_ordering > 0]
        cited = {p for ev in live for p in _prev_event_ids(ev)}
        forked = set()
        for room_id in {ev.room_id for ev in live}:
            if room_id not in self.ends:
                self.ends[room_id] = set(await self.store.get_forward_extremities(room_id))
            ends = {e for e in self.ends[room_id] if e not in cited}
            ends |= {ev.event_id for ev in live if ev.room_id == room_id and ev.event_id not in cited}
            self.ends[room_id] = ends
            if len(ends) > 1:
                forked.add(room_id)
        return forked

    def forget(self) -> None:
        self.ends.clear()


async def _send_page(
    store, reader: SynapseReader, page: list[SynapseEvent], summary: ImportSummary, ends: _RoomEnds, trust_source: bool
) -> tuple[list, Any]:
    """One page handed to the store as one batch, with Synapse's current
    state of each room it may leave forked: (its items, the write's Deferred)."""
    items = await _to_persist(reader, page, trust_source)
    summary.states_from_synapse += sum(item.state_before is not None for _, item in items)
    resolved = await _forked_rooms_states(reader, [ev for ev, _ in items], ends, summary)
    batch = [item for _, item in items]
    return items, defer.ensureDeferred(store.persist_events(batch, resolved_current_state=resolved))


async def _forked_rooms_states(
    reader: SynapseReader, events: Sequence[SynapseEvent], ends: _RoomEnds, summary: ImportSummary
) -> dict[str, StateMap] | None:
    """Synapse's current state of each room ``events`` may leave with
    several forward extremities (``ends`` follows them), or None for none:
    the store would resolve them itself, and Synapse's answer is the one an
    import keeps."""
    forked = await ends.forked_after(events)
    if not forked:
        return None
    summary.current_states_from_synapse += 1
    return await reader.run(_current_states, reader.source, [ev for ev in events if ev.room_id in forked])


async def _settle_page(
    store,
    reader: SynapseReader,
    items: list,
    written: Any,
    summary: ImportSummary,
    report: Report,
    ends: _RoomEnds,
) -> None:
    """A page's outcome counted and reported; when the store refused the
    batch, each event on its own so one bad event is reported and the rest
    imported."""
    try:
        results = await written
    except EVENT_REFUSALS:
        ends.forget()
        results = []
        for ev, item in items:
            try:
                results.extend(await _persist_resolving(store, reader, [ev], [item], summary))
            except EVENT_REFUSALS as exc:
                _skip(summary, report, ev, type(exc).__name__, str(exc))
                continue
    _count(summary, report, [ev for ev, _ in items], results)


def _count(summary: ImportSummary, report: Report, events: Sequence[SynapseEvent], results: Sequence) -> None:
    """The results of a page's events counted, and each reported that the
    store treated otherwise than Synapse (a content hash mismatch, a
    rejection Synapse had not made)."""
    by_id = {ev.event_id: ev for ev in events}
    for result in results:
        if result.already_persisted:
            summary.already_present += 1
            continue
        ev = by_id[result.event_id]
        if result.content_hash_mismatch:
            summary.redacted_content_hash_mismatch += 1
            report(
                {
                    "event_id": ev.event_id,
                    "room_id": ev.room_id,
                    "stream_ordering": ev.stream_ordering,
                    "error": "content hash mismatch",
                    "stored": "redacted",
                }
            )
        summary.events += 1
        summary.outliers += ev.outlier
        summary.rejected += result.rejected_reason is not None
        if result.rejected_reason is not None and ev.rejected_reason is None:
            report(
                {
                    "event_id": ev.event_id,
                    "room_id": ev.room_id,
                    "stream_ordering": ev.stream_ordering,
                    "rejected": result.rejected_reason,
                    "synapse": "accepted",
                }
            )
        summary.backfilled += ev.stream_ordering < 0


async def _persist_resolving(
    store,
    reader: SynapseReader,
    events: Sequence[SynapseEvent],
    batch: Sequence[EventToPersist],
    summary: ImportSummary,
) -> list:
    """``persist_events``, with Synapse's current state of each room the
    batch may leave forked, its rooms' ends read from the store as they
    stand (a page's events retried one by one)."""
    resolved = await _forked_rooms_states(reader, events, _RoomEnds(store), summary)
    return await store.persist_events(batch, resolved_current_state=resolved)


def _prev_event_ids(ev: SynapseEvent) -> list[str]:
    """The prev events an event's JSON names (v1/v2 as [ID, hashes] pairs)."""
    if ev.prev_count == 0:
        return []
    try:  # orjson: several times faster, and reads what json.loads reads
        event = orjson.loads(ev.json)
    except orjson.JSONDecodeError:  # json.loads decides, and words any error as before
        event = json.loads(ev.json)
    prevs = event.get("prev_events") or []
    # v1/v2 cite [ID, hashes]; anything but an ID there is no citation.
    cited = (p[0] if isinstance(p, list) and p else p for p in prevs)
    return [p for p in cited if isinstance(p, str)]


def _current_states(source: SynapseSource, events: Sequence[SynapseEvent]) -> dict[str, StateMap]:
    """Synapse's current state of each room of ``events`` as of the newest of them."""
    newest: dict[str, int] = {}
    for ev in events:
        newest[ev.room_id] = max(newest.get(ev.room_id, ev.stream_ordering), ev.stream_ordering)
    return {room_id: source.current_state_at(room_id, position) for room_id, position in newest.items()}


async def _to_persist(
    reader: SynapseReader, page: Sequence[SynapseEvent], trust_source: bool = False
) -> list[tuple[SynapseEvent, EventToPersist]]:
    """(event, ``EventToPersist``) for each event of the page; an event with
    several prev events gets Synapse's state before it where it can be read."""
    wanted = {
        ev.event_id: (
            (ev.event_type, ev.state_key) if ev.state_key is not None else None,
            ev.rejected_reason is not None,
        )
        for ev in page
        if not ev.outlier and ev.prev_count > 1
    }
    states: Mapping[str, StateMap] = await reader.run(_states_before, reader.source, wanted) if wanted else {}
    return [
        (
            ev,
            EventToPersist(
                ev.json,
                ev.room_version,
                outlier=ev.outlier,
                rejected_reason=ev.rejected_reason,
                backfilled=ev.stream_ordering < 0,
                state_before=states.get(ev.event_id),
                auth_checked=trust_source,
            ),
        )
        for ev in page
    ]


def _states_before(
    source: SynapseSource, wanted: Mapping[str, tuple[tuple[str, str] | None, bool]]
) -> dict[str, StateMap]:
    """Synapse's state before each event where it can be read: its state
    group is the state after it; for an accepted state event Synapse stores
    that group as a one-row delta (the event itself) on the group of the
    state before it. Where neither holds (no group; a group rewritten by a
    compressor) the event is left out and the store derives its state from
    its prev events, refusing it if they conflict."""
    groups = source.state_groups_of(list(wanted))
    found: dict[str, StateMap] = {}
    for event_id, (key, rejected) in wanted.items():
        group = groups.get(event_id)
        if group is None:
            continue
        if key is None or rejected:
            found[event_id] = source.group_state(group)
            continue
        prev, rows = source.group_delta(group)
        if prev is not None and rows == {key: event_id}:
            found[event_id] = source.group_state(prev)
    return found


def _skip(summary: ImportSummary, report: Report, ev: SynapseEvent, reason: str, message: str) -> None:
    summary.skipped[reason] = summary.skipped.get(reason, 0) + 1
    report(
        {
            "event_id": ev.event_id,
            "room_id": ev.room_id,
            "stream_ordering": ev.stream_ordering,
            "error": reason,
            "message": message,
        }
    )
