"""Where ``RoomStore``'s writes run: in this process (``LocalWrites``) or in
its writer process (``ForwardedWrites``, ``StoreConfig.writer_process``).

Every write the store offers (persisting events, a caches-stream row,
censoring expired redactions, deleting state groups, purges) goes through
one ``StoreWrites``, chosen when the store opens; ``RoomStore`` checks the
arguments and hands them over, so it holds no branch on where the work runs.

``LocalWrites.persist_events`` is the write path's order of steps: a call
takes its turn (``WriteTurns``), is validated while earlier calls write,
may be written together with the calls queued behind it in one transaction,
and in that transaction is checked (``precheck_txn``), given its stream IDs
and written (``EventPersister``); the caches learn the batch before its
stream positions complete, so a reader woken by them finds it.

``ForwardedWrites`` sends each call to the writer process and applies to
this process's caches what the reply says changed; the batches the child
commits reach the caches through ``WriterProcess.follow``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from roomstore.events.caches import EVENT_CACHE, StoreCaches, write_cache_invalidations
from roomstore.events.censor import RedactionCensor
from roomstore.events.purge import Purger, PurgeResult
from roomstore.events.write.batch import (
    AssumedVersionWrong,
    EventToPersist,
    PersistedEvent,
    first_copies,
    orphan_rooms,
    results_in_order,
)
from roomstore.events.write.batch_rooms import BatchRooms
from roomstore.events.write.persist import BatchOutcome, EventPersister
from roomstore.events.write.pipeline import BatchValidator, WriteTurns, write_in_group
from roomstore.events.write.precheck import precheck_txn
from roomstore.pdu.parsing import InvalidEventError
from roomstore.pdu.signatures import VerifyKeys
from roomstore.state.groups import StateGroupStore, delete_when_unlocked
from roomstore.storage.database import Database
from roomstore.storage.errors import StorageFullError
from roomstore.streams.reservations import reserve_in_transaction
from roomstore.writer_process.parent import WriterProcess

__all__ = ["ForwardedWrites", "LocalWrites", "StoreWrites"]

#: ``{room_id: {(type, state_key): event_id}}``: state resolved by the caller at a room's ends.
ResolvedState = Mapping[str, Mapping[tuple[str, str], str]]


class StoreWrites(Protocol):
    """The store's writes, wherever they run (arguments already checked)."""

    async def persist_events(
        self,
        events: Sequence[EventToPersist],
        resolved_current_state: ResolvedState | None,
        refuse_hash_mismatch: bool,
        verify_keys: VerifyKeys | None,
    ) -> list[PersistedEvent]: ...

    async def invalidate_cache(self, cache_name: str, keys: list | None) -> int: ...

    async def censor_expired_redactions(self, now_ms: int | None) -> int: ...

    async def delete_state_groups(
        self, ids: list[int], lock_timeout_s: float, poll_interval_s: float, clock: Any
    ) -> int: ...

    async def purge(self, method: str, room_id: str, *args: Any) -> PurgeResult: ...


class LocalWrites:
    """The writes in this process: the writer's turns, its transactions, its caches."""

    def __init__(
        self,
        *,
        db: Database,
        persister: EventPersister,
        validator: BatchValidator,
        batch_rooms: BatchRooms,
        streams: tuple[Any, Any, Any],
        state_groups: StateGroupStore,
        purger: Purger,
        censor: RedactionCensor,
        instance_name: str,
        max_events_per_transaction: int,
        after_persist: Callable[[BatchOutcome], None],
        check_writer_lock: Callable[[], None],
        now_ms: Callable[[], int],
    ):
        self.db = db
        self.persister = persister
        self.validator = validator
        self.batch_rooms = batch_rooms
        #: (events, backfill, caches) stream ID generators.
        self.streams = streams
        self.state_groups = state_groups
        self.purger = purger
        self.censor = censor
        self.instance_name = instance_name
        self.max_events_per_transaction = max_events_per_transaction
        self.after_persist = after_persist
        self.check_writer_lock = check_writer_lock
        self.now_ms = now_ms
        self.turns = WriteTurns()

    #: The look before stream IDs (tests and bench/persist_precheck.py put others in its place).
    precheck = staticmethod(precheck_txn)

    async def persist_events(
        self,
        events: Sequence[EventToPersist],
        resolved_current_state: ResolvedState | None,
        refuse_hash_mismatch: bool,
        verify_keys: VerifyKeys | None,
    ) -> list[PersistedEvent]:
        self.check_writer_lock()
        turn = self.turns.take()
        try:
            return await self._persist_in_turn(turn, events, resolved_current_state, refuse_hash_mismatch, verify_keys)
        except StorageFullError as exc:
            self.turns.out_of_space(turn, exc)
            raise
        finally:
            turn.done()

    async def _persist_in_turn(self, turn, events, resolved_current_state, refuse_hash_mismatch, verify_keys):
        """Validated while earlier calls write, written in its turn, or with
        an earlier call's batch (``WriteTurns``)."""
        rooms = await self.batch_rooms.needed_by(events, turn)
        try:
            return await self._validate_and_write(
                turn, events, rooms, resolved_current_state, refuse_hash_mismatch, verify_keys
            )
        except InvalidEventError as exc:
            if not rooms.assumed:
                raise
            # Validated by the version of a create event in an earlier call,
            # not looked for in the database: where that was a second create
            # event for a room stored at another version (refused), the
            # batch is validated again by the stored version, and written
            # alone. Every earlier call is written by now: the look finds
            # what is stored.
            await turn.ready()
            stored = await self.batch_rooms.needed_by(events)
            as_assumed = all(stored.versions.get(room) == version for room, version in rooms.assumed.items())
            if as_assumed and not isinstance(exc, AssumedVersionWrong):
                raise  # the batch's own error
            return await self._validate_and_write(
                turn, events, stored, resolved_current_state, refuse_hash_mismatch, verify_keys, alone=True
            )

    async def _validate_and_write(
        self, turn, events, rooms, resolved_current_state, refuse_hash_mismatch, verify_keys, alone=False
    ):
        prepared = await self.validator.prepare(
            events, rooms.versions, refuse_hash_mismatch, verify_keys, self_contained=not rooms.whole
        )
        turn.validated(prepared)
        if rooms.assumed:  # the write checks these rooms' versions are stored by then
            assumed = rooms.assumed
            prepared = [ev.with_version_assumed() if ev.pdu.room_id in assumed else ev for ev in prepared]
        # Only a batch with nothing to check against earlier calls' writes
        # (room versions, orphans) and no resolved state may go with another's.
        orphan_rooms_to_check = orphan_rooms(prepared, rooms.versions)
        alone = alone or bool(resolved_current_state) or rooms.unknown or bool(orphan_rooms_to_check)
        offer = None if alone else turn.offer_batch(prepared)
        # Every earlier call's writes are done from here on: this batch's
        # prev events among them are stored, as if the calls had waited.
        await turn.ready()
        if offer is not None and offer.taken:
            return await offer.outcome
        turn.withdraw()
        turn.check_refused()
        self.check_writer_lock()
        await self.batch_rooms.refuse_orphans(prepared, orphan_rooms_to_check)
        followers = [] if alone else turn.take_followers(self.max_events_per_transaction - len(prepared))
        return await write_in_group(lambda batch: self.write(batch, resolved_current_state), prepared, followers)

    async def write(self, prepared, resolved_current_state) -> list[PersistedEvent]:
        """The validated batch written in one transaction; a result per event."""
        # Only an event's first copy gets a stream ID.
        first_index = first_copies(prepared)
        unique = [prepared[index] for index in first_index.values()]
        # Events stored before take no stream IDs, nor do batches the write
        # would refuse whatever it is given (underivable state, an invalid event):
        # found first, in the write's own transaction before it takes the IDs;
        # the write checks again (for another writer storing them or changing
        # the room between the two; that rare race still spends IDs). One
        # transaction for the look, the IDs and the write: on PostgreSQL the
        # IDs come from the sequences in it, where they had cost two more.
        # One caches-stream ID per batch: the batch's invalidations are one fact.
        async with reserve_in_transaction(
            self.streams, "persist_events", self.check_and_write_txn, unique, resolved_current_state, self.now_ms()
        ) as ((results, outcome), _):
            if outcome is not None:
                # Caches first, then the IDs complete (as this block ends): a
                # reader woken by the new position must find the change caches
                # already knowing the batch.
                self.after_persist(outcome)
                results.update(outcome.results)
        return results_in_order(prepared, first_index, results)

    def check_and_write_txn(self, txn, take, unique, resolved_current_state, now_ms):
        """One transaction: the look (``precheck_txn``: events stored before,
        a refusal raised before any ID), the stream IDs of the new events
        (``take``: from the sequences, in this transaction, on PostgreSQL),
        and their write. Returns (results of the stored ones, the write's
        outcome or None)."""
        found = self.precheck(txn, self.persister, unique, resolved_current_state)
        new = [ev for ev in unique if ev.event_id not in found]
        if not new:
            return found, None
        live = sum(1 for ev in new if not ev.backfilled)
        stream_ids, backfill_ids, (cache_stream_id,) = take((live, len(new) - live, 1))
        outcome = self.persister.persist_txn(
            txn, new, stream_ids, backfill_ids, resolved_current_state, cache_stream_id, now_ms
        )
        return found, outcome

    async def invalidate_cache(self, cache_name: str, keys: list | None) -> int:
        async with self.streams[2].get_next() as stream_id:
            await self.db.run_interaction(
                "invalidate_cache",
                write_cache_invalidations,
                stream_id,
                self.instance_name,
                [(cache_name, keys)],
                self.now_ms(),
            )
        return stream_id

    async def censor_expired_redactions(self, now_ms: int | None) -> int:
        return await self.censor.censor_expired(now_ms)

    async def delete_state_groups(
        self, ids: list[int], lock_timeout_s: float, poll_interval_s: float, clock: Any
    ) -> int:
        return await delete_when_unlocked(
            self.db, self.state_groups, ids, lock_timeout_s, poll_interval_s, clock, self.now_ms
        )

    async def purge(self, method: str, room_id: str, *args: Any) -> PurgeResult:
        self.check_writer_lock()
        return await getattr(self.purger, method)(room_id, *args)


class ForwardedWrites:
    """The writes sent to the writer process; this process's caches follow."""

    def __init__(self, process: WriterProcess, caches: StoreCaches):
        self.process = process
        self.caches = caches

    async def persist_events(
        self,
        events: Sequence[EventToPersist],
        resolved_current_state: ResolvedState | None,
        refuse_hash_mismatch: bool,
        verify_keys: VerifyKeys | None,
    ) -> list[PersistedEvent]:
        return await self.process.call(
            "persist_events",
            list(events),
            resolved_current_state,
            refuse_hash_mismatch=refuse_hash_mismatch,
            verify_keys=verify_keys,
        )

    async def invalidate_cache(self, cache_name: str, keys: list | None) -> int:
        return await self.process.call("invalidate_cache", cache_name, keys)

    async def censor_expired_redactions(self, now_ms: int | None) -> int:
        censored = await self.process.call("censor_expired_redactions", now_ms)
        if censored:  # which ones the reply does not say: drop every parsed event
            self.caches.apply_invalidation(EVENT_CACHE, None)
        return censored

    async def delete_state_groups(
        self, ids: list[int], lock_timeout_s: float, poll_interval_s: float, clock: Any
    ) -> int:
        # The writer process waits on its own clock.
        return await self.process.call(
            "delete_state_groups", ids, lock_timeout_s=lock_timeout_s, poll_interval_s=poll_interval_s
        )

    async def purge(self, method: str, room_id: str, *args: Any) -> PurgeResult:
        result = await self.process.call(method, room_id, *args)
        if result.changed:  # the child dropped its caches; this process drops its own
            self.caches.purged([room_id], whole_room=method == "purge_room")
        return result

    async def close(self) -> None:
        await self.process.close()
