"""``RoomStore``: the object a homeserver embeds.

It composes the pieces (database, interning, state groups, visibility, the
event persister and readers, stream ID generators and change caches) and
offers async methods. Everything that touches the database runs through
``Database.run_interaction``; caches are updated only after commits.

    store = await RoomStore.open("sqlite:///var/roomstore.db")
    results = await store.persist_events([EventToPersist(raw_bytes, "10")])
    event = await store.get_event(results[0].event_id)

The values an embedder hands it are importable from here too, with it:
``StoreConfig``, ``EventToPersist`` and ``ClientTxn`` (the homeserver in
``roomstore.homeserver`` imports nothing else of the store).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs
from twisted.internet import defer

from roomstore.events.batch import (
    ClientTxn,
    EventToPersist,
    PersistedEvent,
)
from roomstore.events.batch_rooms import BatchRooms
from roomstore.events.caches import StoreCaches
from roomstore.events.censor import RedactionCensor
from roomstore.events.client_format import format_client_events
from roomstore.events.event_reader import EventFlags, EventReader
from roomstore.events.federation import FederationReader
from roomstore.events.pagination import PaginationResult, Paginator
from roomstore.events.persist import BatchOutcome, EventPersister
from roomstore.events.pipeline import BatchValidator
from roomstore.events.purge import Purger, PurgeResult
from roomstore.events.read_positions import ReadPositions, register_instance_txn
from roomstore.events.sync import SyncReader, SyncResult
from roomstore.events.tables.client_txns import event_id_for_txn_txn
from roomstore.events.timeline import RecentResult, TimelineReader
from roomstore.events.user_rooms import RoomMembership, check_memberships, rooms_by_membership_txn
from roomstore.pdu.signatures import VerifyKeys
from roomstore.state.groups import (
    COMPACTION_LOCK_TIMEOUT_S,
    StateGroupStore,
)
from roomstore.storage.database import Database
from roomstore.storage.interning import Interners, room_ids_txn
from roomstore.storage.maintenance_locks import COMPACTION_LOCK_NAME
from roomstore.storage.stats import table_stats_txn
from roomstore.storage.writer_lock import WriterLock
from roomstore.store_config import StoreConfig
from roomstore.store_opening import open_database
from roomstore.store_replication import ReplicationFace
from roomstore.store_writes import ForwardedWrites, LocalWrites, StoreWrites
from roomstore.streams.change_cache import StreamChangeCache
from roomstore.streams.view import GeneratorView
from roomstore.visibility.snapshots import VisibilityStore
from roomstore.writer_process.parent import WriterProcess

#: What an embedder imports from here (see the module docstring).
__all__ = ["ClientTxn", "EventToPersist", "RoomStore", "StoreConfig"]


class RoomStore(ReplicationFace):
    """The event store. Construct with ``await RoomStore.open(url_or_database)``.

    Its face for replication (stream pages, others' writes applied) is
    ``ReplicationFace``'s (``roomstore/store_replication.py``)."""

    def __init__(self, db: Database, config: StoreConfig, generators: Mapping[str, Any], clock: Any = None):
        self.db = db
        self.config = config
        self.instance_name = config.instance_name
        self.generators = dict(generators)
        self.events_stream = self.generators["events"]
        self.backfill_stream = self.generators["backfill"]
        self.caches_stream = self.generators["caches"]
        #: The built-in streams (``events``, ``backfill``, ``caches``); ``stream(name)`` gives each one's positions.
        self.stream_names = tuple(self.generators)
        self._stream_views = {name: GeneratorView(generator) for name, generator in self.generators.items()}
        self.interners = Interners()
        self.state_groups = StateGroupStore(config.max_state_chain_length)
        self.visibility = VisibilityStore()
        #: Drives periodic jobs and bounded waits, and is "now" for the
        #: timestamps the store writes (``RoomStore.open``'s ``clock``).
        self.clock = clock if clock is not None else db.reactor
        self.persister = EventPersister(
            self.interners, self.state_groups, self.visibility, config.instance_name, self.clock
        )
        self.batch_rooms = BatchRooms(db, self.persister.room_versions)
        # Batches validated off the reactor, written in call order (events/pipeline.py).
        self.validator = BatchValidator(db.reactor, config.validation_processes)
        position = self.events_stream.get_current_token()
        # Which rooms had new events, whose membership changed, since a position.
        self.room_changes = StreamChangeCache("room_events", position, config.change_cache_size)
        self.membership_changes = StreamChangeCache("user_memberships", position, config.change_cache_size)
        self.reader = EventReader(db, self.interners, self.state_groups, self.events_stream, config.event_cache_size)
        self.positions = ReadPositions(db, self.events_stream, config.instance_name, config.token_wait_ms, self.clock)
        self.timeline = TimelineReader(
            db, self.interners, self.positions, self.reader, self.room_changes, self.membership_changes
        )
        self.pagination = Paginator(self.timeline)
        self.syncs = SyncReader(self.timeline)
        self.federation = FederationReader(db, self.interners, self.reader)
        #: What each change drops from this process's caches (replication
        #: applies a worker's rows through it too).
        self.caches = StoreCaches(
            self.reader,
            self.room_changes,
            self.membership_changes,
            self.persister.parsed_events,
            self.persister.room_versions,
        )
        self.purger = Purger(
            db,
            self.interners,
            self.state_groups,
            self.positions,
            self.caches,
            (self.events_stream, self.backfill_stream, self.caches_stream),
            config.instance_name,
            config.server_name,
            self.clock,
            self._now_ms,
        )
        self.censor = RedactionCensor(
            db, self.interners, self.caches.event_changed, config.redaction_retention_ms, self.clock
        )
        self._invalidation_hooks: list = []
        #: Where the writes run: here, or in the writer process (``_open_beside_writer``).
        self.writes: StoreWrites = self._local_writes()
        #: The schema version the database is at (set by ``open``).
        self.schema_version: int | None = None
        # Set by ``open``: whether closing the store closes the database, the
        # writer's lock (None: read-only, or SQLite in memory), the periodic censor.
        self._owns_db = False
        self._writer_lock: WriterLock | None = None
        self._censor_job: RedactionCensor | None = None

    def _local_writes(self) -> LocalWrites:
        """The writes run in this process, through this store's parts."""
        return LocalWrites(
            db=self.db,
            persister=self.persister,
            validator=self.validator,
            batch_rooms=self.batch_rooms,
            streams=(self.events_stream, self.backfill_stream, self.caches_stream),
            state_groups=self.state_groups,
            purger=self.purger,
            censor=self.censor,
            instance_name=self.config.instance_name,
            max_events_per_transaction=self.config.max_events_per_transaction,
            after_persist=self._after_persist,
            check_writer_lock=self.check_writer_lock,
            now_ms=self._now_ms,
        )

    @classmethod
    async def open(
        cls,
        database: str | Database,
        config: StoreConfig | None = None,
        reactor: Any = None,
        clock: Any = None,
        create: bool = True,
    ) -> RoomStore:
        """Open (and migrate) the database, recover stream positions.

        ``clock`` drives periodic jobs and the wait for a token ahead of this
        process, and is "now" for the timestamps the store writes (default:
        the database's reactor).
        ``create=False``: a database URL naming a SQLite file that does not
        exist raises ``DatabaseConfigError`` instead of creating it.
        ``StoreConfig(read_only=True)``: nothing is written, the schema neither
        created nor upgraded (``SchemaError`` says to run ``roomstore init``).
        """
        config = config or StoreConfig()
        if config.writer_process and config.writes_anything():
            return await cls._open_beside_writer(database, config, reactor, clock, create)
        opened = await open_database(database, config, reactor, create)
        store = cls(opened.db, config, opened.generators, clock)
        store.schema_version = opened.schema_version
        store._owns_db = opened.owns_db
        store._writer_lock = writer_lock = opened.writer_lock
        if writer_lock is not None:
            # A database restart frees a session lock: take it again, or stop.
            writer_lock.watch(store.clock)
        if not config.read_only:
            await store.db.run_interaction("register_instance", register_instance_txn, config.instance_name)
        if config.censor_interval_ms is not None:
            store._censor_job = store.censor
            store._censor_job.start(config.censor_interval_ms)
        if config.writes_anything():
            await store.validator.start()
        return store

    @classmethod
    async def _open_beside_writer(cls, database, config: StoreConfig, reactor, clock, create: bool) -> RoomStore:
        """``writer_process``: a child process opens the database as the
        writer (creating, migrating it); this one opens it read-only and
        learns the child's commits from its replies."""
        fields = attrs.asdict(attrs.evolve(config, writer_process=False), recurse=False)
        writer = await WriterProcess.start(reactor, database, fields, create)
        try:
            here = attrs.evolve(config, writer_process=False, read_only=True, censor_interval_ms=None)
            store = await cls.open(database, here, reactor, clock, create=False)
        except BaseException:
            await writer.close()
            raise
        store.config, store.writes = config, ForwardedWrites(writer, store.caches)
        writer.follow(store._after_persist, store.generators)
        return store

    def writer_lock_lost(self) -> defer.Deferred | None:
        """Fires with a ``WriterLockLost`` (its result, not an error) if this
        writer's lock went with a database session and another process took
        it; None for a process that holds no lock (read-only, SQLite in memory)."""
        lock = self._writer_lock
        return None if lock is None else lock.lost

    def check_writer_lock(self) -> None:
        """Raise ``WriterLockLost`` once this writer's lock is lost for good."""
        lost = self.writer_lock_lost()
        if lost is not None and lost.called and isinstance(lost.result, BaseException):
            raise lost.result

    async def close(self) -> None:
        if isinstance(self.writes, ForwardedWrites):
            await self.writes.close()
        censor_job = self._censor_job
        if censor_job is not None:
            # Before the database goes: stop() waits for a run in progress.
            await censor_job.stop()
        for gen in self.generators.values():
            await gen.close()
        writer_lock, self._writer_lock = self._writer_lock, None
        if writer_lock is not None:
            await writer_lock.release()
        await self.validator.close()
        if self._owns_db:
            await self.db.close()

    # ------------------------------------------------------------------ persistence

    async def persist_events(
        self,
        events: Sequence[EventToPersist],
        resolved_current_state: Mapping[str, Mapping[tuple[str, str], str]] | None = None,
        *,
        refuse_hash_mismatch: bool = False,
        verify_keys: VerifyKeys | None = None,
    ) -> list[PersistedEvent]:
        """Persist a batch atomically; returns one result per event given, in order.

        An event stored before is a no-op reporting its existing position.
        An event whose content hash does not match is stored in its redacted
        form, its result's ``content_hash_mismatch`` set (also when it was
        stored before: the flag tells of the copy given); with
        ``refuse_hash_mismatch`` the batch is refused (``ContentHashMismatch``).
        With ``verify_keys`` (``roomstore.pdu.signatures``) signatures are
        checked where the keys allow: a bad one refuses the batch
        (``InvalidSignature``); ``signatures_checked`` says whether an
        event's every needed signature was verified.
        Raises ``InvalidEventError`` (bad bytes or fields, references to
        another room, a cycle), ``MissingStateError`` (state cannot be
        derived); nothing is written then, and no stream position moves.
        Where prev events' states, or a room's ends' states, differ, the room
        version's state resolution decides (``resolved_current_state``, given,
        stands in for it at the room's ends).
        """
        if not events:
            return []
        return await self.writes.persist_events(events, resolved_current_state, refuse_hash_mismatch, verify_keys)

    def _now_ms(self) -> int:
        """The store clock's now, in milliseconds (the timestamps it writes)."""
        return int(self.clock.seconds() * 1000)

    def _after_persist(self, outcome: BatchOutcome) -> None:
        self.caches.batch_committed(outcome)
        for hook in self._invalidation_hooks:
            hook(outcome)

    async def invalidate_cache(self, cache_name: str, keys: Sequence | None) -> int:
        """Tell every process to drop ``keys`` (None: everything) of a cache.

        Writes one row of the caches stream; returns its stream ID.
        """
        if not cache_name or any(c.isspace() for c in cache_name):
            raise ValueError(f"cache name {cache_name!r} must be a non-empty word")
        return await self.writes.invalidate_cache(cache_name, None if keys is None else list(keys))

    def add_invalidation_hook(self, hook) -> None:
        """Call ``hook(outcome)`` after every committed batch (with
        ``writer_process``, one whose ``results`` and ``new_event_ids`` are
        empty: the calls' own results carry them)."""
        self._invalidation_hooks.append(hook)

    # ------------------------------------------------------------------ reads
    # Thin async wrappers: the SQL lives in roomstore.events.event_reader.

    async def get_event(self, event_id: str, redact: bool = True, allow_rejected: bool = False) -> dict | None:
        """The served event (None if not stored, or rejected unless ``allow_rejected``)."""
        return (await self.get_events([event_id], redact, allow_rejected)).get(event_id)

    async def get_events(
        self, event_ids: Iterable[str], redact: bool = True, allow_rejected: bool = False
    ) -> dict[str, dict]:
        return await self.reader.get_events(list(event_ids), redact=redact, allow_rejected=allow_rejected)

    async def get_event_flags(self, event_ids: Sequence[str]) -> dict[str, EventFlags]:
        """Outlier, rejection, redaction and stream position of those of
        ``event_ids`` that are stored (the others are absent from the result)."""
        return await self.db.run_interaction("get_event_flags", self.reader.flags_txn, list(event_ids))

    async def get_topological_token(self, event_id: str) -> str:
        """``t<topo>-<stream>``, the position just after a stored graph event
        (``NotFoundError`` for one not stored, or an outlier)."""
        return await self.db.run_interaction("get_topological_token", self.reader.topological_token_txn, event_id)

    async def format_client_events(
        self, events: Sequence[dict], now_ms: int | None = None, sent_by: tuple[str, str] | None = None
    ) -> list[dict]:
        """Served events in the client-server API's format (``roomstore.events.client_format``): ``age`` at
        ``now_ms`` (default: the store's clock), ``transaction_id`` for the device ``sent_by`` (user, device)."""
        now_ms = self._now_ms() if now_ms is None else now_ms
        return await format_client_events(self.reader, self.db, events, now_ms, sent_by)

    async def get_event_json_bytes(self, event_id: str) -> bytes | None:
        return await self.db.run_interaction("get_event_json_bytes", self.reader.json_bytes_txn, event_id)

    async def get_state_ids(self, event_id: str, before: bool = False) -> dict[tuple[str, str], str]:
        return await self.db.run_interaction("get_state_ids", self.reader.state_ids_txn, event_id, before, None)

    async def get_state_ids_filtered(
        self, event_id: str, types: Iterable[tuple[str, str | None]], before: bool = False
    ) -> dict[tuple[str, str], str]:
        return await self.db.run_interaction("get_state_ids", self.reader.state_ids_txn, event_id, before, list(types))

    async def get_state_ids_for_events(
        self, event_ids: Iterable[str], before: bool = False
    ) -> dict[str, dict[tuple[str, str], str]]:
        """``get_state_ids`` of many events in one transaction (those not stored, or outliers, left out)."""
        return await self.db.run_interaction(
            "get_state_ids_for_events", self.reader.state_ids_for_events_txn, list(event_ids), before
        )

    async def get_auth_chain_ids(self, event_ids: Iterable[str]) -> set[str]:
        """Every event in the auth chains of ``event_ids`` (their auth events, theirs, ...)."""
        return await self.db.run_interaction("get_auth_chain_ids", self.reader.auth_chain_ids_txn, list(event_ids))

    async def get_auth_chain_difference(self, state_sets: Sequence[Iterable[str]]) -> set[str]:
        """State resolution v2's auth difference of ``state_sets`` (sets of
        event IDs): what some but not every set's events and auth chains hold."""
        return await self.db.run_interaction(
            "get_auth_chain_difference", self.reader.auth_chain_difference_txn, [set(s) for s in state_sets]
        )

    async def get_current_state_ids(
        self, room_id: str, types: Iterable[tuple[str, str | None]] | None = None
    ) -> dict[tuple[str, str], str]:
        return await self.db.run_interaction(
            "get_current_state_ids", self.reader.current_state_txn, room_id, None if types is None else list(types)
        )

    async def get_forward_extremities(self, room_id: str) -> list[str]:
        return await self.db.run_interaction("get_forward_extremities", self.reader.extremities_txn, room_id, "forward")

    async def get_backward_extremities(self, room_id: str) -> list[str]:
        return await self.db.run_interaction(
            "get_backward_extremities", self.reader.extremities_txn, room_id, "backward"
        )

    async def get_rooms_for_user(self, user_id: str) -> frozenset[str]:
        return await self.reader.get_rooms_for_user(user_id)

    async def get_rooms_for_user_by_membership(
        self, user_id: str, memberships: Collection[str]
    ) -> list[RoomMembership]:
        """The user's current membership of each room where it is one of
        ``memberships``, out-of-band (outlier) invites included
        (``roomstore.events.user_rooms``); ``ValueError`` for an unknown one."""
        asked = check_memberships(memberships)
        return await self.db.run_interaction(
            "get_rooms_for_user_by_membership", rooms_by_membership_txn, self.interners, user_id, asked
        )

    async def get_event_id_for_txn(self, user_id: str, device_id: str, txn_id: str) -> str | None:
        """The event persisted with ``ClientTxn(user_id, device_id, txn_id)``, None if none was."""
        return await self.db.run_interaction("get_event_id_for_txn", event_id_for_txn_txn, user_id, device_id, txn_id)

    async def get_users_in_room(self, room_id: str) -> list[str]:
        return await self.db.run_interaction("get_users_in_room", self.reader.users_in_room_txn, room_id)

    def get_current_token(self) -> str:
        return self.reader.current_token().to_string()

    async def get_room_version(self, room_id: str) -> str | None:
        """The room's version, None for a room whose create event is not stored."""
        return (await self.batch_rooms.versions([room_id])).get(room_id)

    async def get_room_ids(self) -> list[str]:
        """Every room the store has seen an event of, in the order first seen."""
        return await self.db.run_interaction("get_room_ids", room_ids_txn)

    # --- redaction censoring (roomstore.events.censor)

    async def censor_expired_redactions(self, now_ms: int | None = None) -> int:
        """Replace the bytes of redacted events whose redaction is older than
        ``config.redaction_retention_ms`` (at ``now_ms``, default the store's
        clock) with their pruned JSON; returns how many events were censored.
        """
        return await self.writes.censor_expired_redactions(now_ms)

    # --- state group deletion (honours the compaction lock)

    #: The compaction job's lock and its staleness (``roomstore.state.groups``).
    COMPACTION_LOCK_NAME = COMPACTION_LOCK_NAME
    COMPACTION_LOCK_TIMEOUT_S = COMPACTION_LOCK_TIMEOUT_S

    async def delete_state_groups(
        self,
        group_ids: Iterable[int],
        *,
        lock_timeout_s: float | None = None,
        poll_interval_s: float = 1.0,
        clock: Any = None,
    ) -> int:
        """Delete state groups (their ``state_groups`` and delta rows); returns how many existed.

        Waits, polling every ``poll_interval_s``, while the state compaction
        job holds its lock with a heartbeat younger than ``lock_timeout_s``
        (default ``COMPACTION_LOCK_TIMEOUT_S``): the job must never rewrite a
        group that is being deleted. An older heartbeat means the job died;
        the lock is then ignored with a warning. The check and the deletion are
        one transaction, and the job re-checks every group in its own swap
        transaction, so neither order loses a group's state.

        Remaining groups stored as a delta against a deleted group are first
        rewritten as snapshots of their full state, so no remaining group's
        state changes. The caller (a purge) is responsible for nothing else
        referring to the deleted groups (events, ``rooms.current_state_group``).
        """
        ids = sorted({int(g) for g in group_ids})
        if not ids:
            return 0
        timeout_s = self.COMPACTION_LOCK_TIMEOUT_S if lock_timeout_s is None else lock_timeout_s
        deleted = await self.writes.delete_state_groups(ids, timeout_s, poll_interval_s, clock or self.clock)
        for group in ids:
            self.state_groups.forget(group)
        return deleted

    # --- purges (roomstore.events.purge)

    async def purge_history(self, room_id: str, before_token: str, delete_local_events: bool = False) -> PurgeResult:
        """Delete the room's events at or before the position ``before_token``
        (a ``t`` or stream token), keeping what the room still needs; one
        transaction (docs/api.md, "Purging")."""
        return await self.writes.purge("purge_history", room_id, before_token, delete_local_events)

    async def purge_room(self, room_id: str) -> PurgeResult:
        """Delete every row of the room; one transaction (docs/api.md, "Purging")."""
        return await self.writes.purge("purge_room", room_id)

    # --- timeline and federation reads (roomstore.events.timeline, .federation)
    # Thin async wrappers; contracts and SQL in those modules.

    async def sync(
        self,
        user_id: str,
        since: str | None,
        initial_limit: int = 10,
        limit: int | None = None,
        full_state: bool = False,
    ) -> SyncResult:
        """New visible events in the user's rooms since a stream token (the
        newest ``limit`` a room, None: all), each room's ``RoomTimeline``, and
        the user's own membership events in any room; ``since=None``: an initial
        sync, the newest ``initial_limit`` visible events of each joined room."""
        return await self.syncs.sync(user_id, since, initial_limit, limit, full_state)

    async def recent(self, user_id: str, rooms: int, events: int, from_cursor: str | None = None) -> RecentResult:
        """The newest ``events`` visible events of the user's ``rooms`` most
        recently active joined rooms, paged over rooms by ``from_cursor``."""
        return await self.timeline.recent(user_id, rooms, events, from_cursor)

    async def paginate(
        self, room_id: str, user_id: str, from_token: str | None, direction: str, limit: int
    ) -> PaginationResult:
        """A visible page of a room in topological order (``"b"``/``"f"``)."""
        return await self.pagination.paginate(room_id, user_id, from_token, direction, limit)

    async def is_visible(self, user_id: str, event_id: str) -> bool:
        """Whether the timelines would show ``event_id`` to ``user_id``."""
        return await self.timeline.is_visible(user_id, event_id)

    async def backfill(self, room_id: str, event_ids: Sequence[str], limit: int) -> list[dict]:
        """Federation backfill from ``event_ids`` (inclusive), in topological order."""
        return await self.federation.backfill(room_id, event_ids, limit)

    async def get_missing_events(
        self, room_id: str, earliest_events: Sequence[str], latest_events: Sequence[str], limit: int
    ) -> list[dict]:
        """Federation missing events between ``earliest_events`` and ``latest_events``."""
        return await self.federation.get_missing_events(room_id, earliest_events, latest_events, limit)

    # ------------------------------------------------------------------ the database, for the command line

    def describe_database(self) -> str:
        """The database in a few words (engine and where), no password."""
        return self.db.engine.describe()

    @property
    def max_connections(self) -> int:
        """How many connections the database pool opens at most."""
        return self.db.engine.max_connections

    async def table_stats(self) -> list[dict]:
        """``{"table", "rows", "bytes"}`` of every table of the schema."""
        return await self.db.run_interaction("stats", table_stats_txn)
