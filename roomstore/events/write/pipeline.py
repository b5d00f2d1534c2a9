"""The writer's pipeline: validation off the reactor, writes in call order.

``RoomStore.persist_events`` validates a batch (strict JSON parsing, the
reference hash that is the event ID, the content hash, signatures) with
``BatchValidator``: in worker processes (``StoreConfig.validation_processes``)
or on a thread of its own, so the reactor thread only schedules it; and
writes batches through ``WriteTurns``, one at a time, in the order the calls
were made. Together they let a writer keep several batches in flight: the
next batch is validated (on other cores) while the previous one's
transaction runs, and a batch whose prev events are in an earlier, still
running call finds them stored when its own turn comes, as if each call had
waited for the one before.

Validation is pure Python for the most part and holds the GIL: on a thread,
a reactor waiting for it waits up to ``sys.getswitchinterval()`` each time
it needs the interpreter back; in worker processes it holds none of the
homeserver's. What remains in the homeserver's process (the transaction's
own Python on the database thread) is why ``docs/internals.md`` advises a
homeserver that wants its reactor's lateness under a few milliseconds to
lower the switch interval.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from twisted.internet import defer, threads
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from roomstore.events.write.batch import EventToPersist, PreparedEvent, prepare_events
from roomstore.events.write.validation_worker import HEADER, READY, frame, rebuilt_error
from roomstore.pdu.signatures import VerifyKeys
from roomstore.storage.errors import DatabaseConfigError

__all__ = ["BatchValidator", "MIN_CHUNK", "Offer", "WriteTurns", "write_in_group"]


#: A batch is split among the worker processes in chunks of at least this
#: many events; a smaller batch is validated on the thread (a process's round
#: trip is not worth it).
MIN_CHUNK = 25
#: The validator's thread lets the GIL go after every this many events (about
#: a quarter of a millisecond of work), so the reactor waits no longer for it.
PAUSE_EVERY = 8


class BatchValidator:
    """``prepare_events`` off the reactor thread.

    Everything runs on threads of the validator's own (never the
    database's: an SQLite store has one database thread, which its writes
    need), so the reactor only hands a batch over and gets the result back.
    With ``processes`` > 0, a thread splits a batch of at least
    ``MIN_CHUNK`` events in order-keeping chunks among as many worker
    processes (``events/write/validation_worker.py``; started with the store,
    stopped with it), which run on other cores and hold none of the
    homeserver's GIL; the thread only pickles, writes, waits and unpickles.
    Two such threads keep a worker busy: the next batch is in its pipe while
    the last one's reply waits for the GIL to be unpickled (each worker
    answers in the order it was asked, and each thread reads its replies in
    that order, ``_Worker.receive``).
    Smaller batches, and all batches with ``processes=0``, are validated on
    the thread itself. A batch whose events need a create event of the same
    batch for their room version is validated whole. Either way the result is
    the batch's events in order, and an invalid batch raises what
    ``prepare_events`` raises on it: the first invalid event's error, its type
    and attributes intact. A worker that dies loses nothing: its chunk is
    validated on the thread and a new worker starts for the next batch.
    """

    def __init__(self, reactor: Any, processes: int = 0):
        if processes < 0:
            raise ValueError(f"validation_processes must be 0 or more, not {processes}")
        self._reactor = reactor
        self._processes = processes
        self._pool = ThreadPool(minthreads=0, maxthreads=2 if processes else 1, name="roomstore-validation")
        self._started = False
        self._closed = False
        self._shutdown_trigger = None
        #: Worker processes; changed by the validator's threads, under
        #: ``_workers_lock`` (and by ``close`` once they have stopped).
        self._workers: list[_Worker] = []
        self._workers_lock = threading.Lock()
        self._send_lock = threading.Lock()
        #: Chunks a dead worker left, validated on the thread instead (tests read it).
        self.fallbacks = 0

    async def prepare(
        self,
        events: Sequence[EventToPersist],
        known_versions: Mapping[str, str],
        refuse_hash_mismatch: bool = False,
        verify_keys: VerifyKeys | None = None,
        self_contained: bool = True,
    ) -> list[PreparedEvent]:
        """The batch validated, in order; raises what ``prepare_events`` raises.

        ``self_contained``: every event's room version is given, known or its
        own (a create event), so the batch may be split.
        """
        if self._closed:
            raise RuntimeError("the store is closed")
        args = (known_versions, refuse_hash_mismatch, verify_keys)
        if self._processes <= 0 or len(events) < MIN_CHUNK or not all(isinstance(e, EventToPersist) for e in events):
            return await self._on_thread(prepare_events, events, *args, PAUSE_EVERY)
        parts = min(self._processes, len(events) // MIN_CHUNK) if self_contained else 1
        bounds = [len(events) * i // parts for i in range(parts + 1)]
        chunks = [list(events[bounds[i] : bounds[i + 1]]) for i in range(parts)]
        return await self._on_thread(self._in_processes, chunks, args)

    async def start(self) -> None:
        """Start the worker processes now, not with the first batch that
        needs them: a worker's start (an interpreter importing the package)
        then delays no batch. ``RoomStore.open`` calls it."""
        if self._processes > 0 and not self._closed:
            await self._on_thread(self._spawn_workers, self._processes)

    def _spawn_workers(self, count: int) -> list[_Worker]:
        """(On a validator's thread.) Live workers topped up to ``count``; the first ``count``."""
        with self._workers_lock:
            self._workers = [w for w in self._workers if w.alive()]
            while len(self._workers) < count:
                self._workers.append(_Worker.spawn())
            return self._workers[:count]

    async def _on_thread(self, fn, *args):
        if not self._started:
            self._pool.start()
            self._started = True
            self._shutdown_trigger = self._reactor.addSystemEventTrigger("during", "shutdown", self._stop_now)
        return await threads.deferToThreadPool(self._reactor, self._pool, fn, *args)

    def _in_processes(self, chunks: list[list], args: tuple) -> list[PreparedEvent]:
        """(On a validator's thread.) Each chunk to a worker, all at once,
        then every reply read (in its worker's turn) before the first error is
        raised, so each worker's pipe stays in step."""
        workers = self._spawn_workers(len(chunks))
        # A batch's chunks are sent together: every worker then has the
        # batches in one order, and the first one's thread can always read
        # all its replies (a thread blocked sending waits for no later one).
        with self._send_lock:
            sent = [(worker, worker.send((chunk, *args)), chunk) for worker, chunk in zip(workers, chunks, strict=True)]
        outcomes = []
        for worker, ticket, chunk in sent:
            reply = worker.receive(ticket) if ticket is not None else None
            if reply is None:  # the worker is gone: this thread does its chunk
                with self._workers_lock:
                    self.fallbacks += 1
                try:
                    reply = (True, prepare_events(chunk, *args))
                except Exception as failed:  # noqa: BLE001 - raised below, in chunk order
                    reply = (False, failed)
            outcomes.append(reply)
        prepared: list[PreparedEvent] = []
        for ok, result in outcomes:
            if not ok:
                raise result if isinstance(result, BaseException) else rebuilt_error(result)
            prepared.extend(result)
        return prepared

    def _stop_now(self) -> None:
        """At reactor shutdown: tell the workers to leave, stop the thread."""
        for worker in self._workers:
            worker.close_input()
        if self._started:
            self._pool.stop()

    async def close(self) -> None:
        """Stop the thread (after a validation in progress) and the workers (waits for them to leave)."""
        if self._closed:
            return
        self._closed = True
        if self._shutdown_trigger is not None:
            self._reactor.removeSystemEventTrigger(self._shutdown_trigger)
        if not self._started:
            return
        # On the validator's own thread (never the reactor's pool, which an
        # embedding that does not run the reactor, as under asyncio, never starts).
        workers = self._workers
        await threads.deferToThreadPool(self._reactor, self._pool, lambda: [w.stop() for w in workers])
        self._pool.stop()


class _Worker:
    """One worker process and its pipes (blocking). Threads may share it:
    ``send`` gives each request a ticket, and ``receive(ticket)`` waits for
    the replies before it to be read, as the worker answers in order. Sends
    are serialised by the caller (``BatchValidator._send_lock``, which also
    keeps a batch's chunks together across workers)."""

    #: Seconds a stopping worker gets to leave before it is killed.
    STOP_GRACE_S = 5.0

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self._turn = threading.Condition()
        self._sent = 0  # tickets given
        self._read = 0  # replies read (or found missing)

    @classmethod
    def spawn(cls) -> _Worker:
        """A started worker, once it has said it is ready (its interpreter
        up, its imports done: about half a second, spent here rather than
        inside the first batch). One that dies first is returned dead: its
        chunks fall back to the thread."""
        argv = [sys.executable, "-m", "roomstore.events.write.validation_worker"]
        worker = cls(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True))
        if worker._read_reply() != READY:
            worker.stop()
        return worker

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, request: tuple) -> int | None:
        """(Under ``BatchValidator._send_lock``.) Write a request; its ticket,
        or None if the worker is gone."""
        try:
            self.process.stdin.write(frame(request))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        self._sent += 1
        return self._sent - 1

    def receive(self, ticket: int) -> tuple | None:
        """The reply to request ``ticket``, once those before it are read;
        None if the worker ended first."""
        with self._turn:
            while self._read != ticket:
                self._turn.wait()
            try:
                return self._read_reply()
            finally:
                self._read += 1
                self._turn.notify_all()

    def _read_reply(self) -> tuple | None:
        stdout = self.process.stdout
        try:
            header = stdout.read(HEADER.size)
            if len(header) < HEADER.size:
                return None
            (length,) = HEADER.unpack(header)
            body = stdout.read(length)
        except (OSError, ValueError):  # closed by stop()
            return None
        if len(body) < length:
            return None
        return pickle.loads(body)

    def close_input(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def stop(self) -> None:
        """Close its input (it leaves at the end), wait, kill if it lingers."""
        self.close_input()
        try:
            self.process.wait(self.STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


class WriteTurns:
    """Turns taken in call order: ``take()`` at a call's start, ``await
    turn.ready()`` before its writes (every earlier turn is done then, however
    it ended), ``turn.done()`` when they are finished (always: a ``finally``).

    Group commit: a call validated while an earlier one writes may ``offer``
    its batch; the call whose turn comes first takes the consecutive offers
    after its own (``take_followers``) and writes them in its transaction
    (``write_in_group``), one commit for all. A taken call finds its outcome
    on its offer when its turn comes."""

    def __init__(self) -> None:
        self._last: defer.Deferred = defer.succeed(None)
        self.in_flight = 0
        #: Turns not done yet, in call order.
        self._open: list[_Turn] = []

    def out_of_space(self, failed: _Turn, exc: BaseException) -> None:
        """``failed``'s write ran out of space: every call queued behind it
        now is refused with the same error when its turn comes, not tried on
        a disk just found full (one might fit where the other did not, and
        the caller, stopping at the first refusal, would not hear of it).
        Calls made later are tried again."""
        for later in self._open[self._open.index(failed) + 1 :]:
            later.refused = later.refused or exc

    def take(self) -> _Turn:
        mine: defer.Deferred = defer.Deferred()
        turn = _Turn(self, self._last, mine)
        self._last = mine
        self.in_flight += 1
        self._open.append(turn)
        return turn


class Offer:
    """A validated batch waiting for its turn, which an earlier call may take
    and write with its own; ``outcome`` fires with the batch's results (or
    its error) then."""

    __slots__ = ("prepared", "taken", "outcome")

    def __init__(self, prepared: Sequence[PreparedEvent]):
        self.prepared = list(prepared)
        self.taken = False
        self.outcome: defer.Deferred = defer.Deferred()


def _observed(deferred: defer.Deferred[Any]) -> defer.Deferred[Any]:
    """A fresh Deferred firing with ``deferred``'s result (a turn's, which
    only ever succeeds): awaiting it takes the result away from no one else
    waiting on ``deferred``."""
    waiter: defer.Deferred[Any] = defer.Deferred()
    deferred.addBoth(lambda result: (waiter.callback(result), result)[1])
    return waiter


class _Turn:
    def __init__(self, turns: WriteTurns, before: defer.Deferred, mine: defer.Deferred):
        self._turns = turns
        self._before = before
        self._mine = mine
        self._ready = False
        self.offer: Offer | None = None
        #: The error an earlier call's write met that refuses this one (``WriteTurns.out_of_space``).
        self.refused: BaseException | None = None
        #: Fires with room ID -> version of the create events the call's
        #: batch holds, once validated (empty when it failed or had none).
        self._creates: defer.Deferred = defer.Deferred()

    def earlier_in_flight(self) -> bool:
        """Whether an earlier call's writes may still be to come."""
        return not self._ready and not self._before.called

    def validated(self, prepared: Sequence[PreparedEvent]) -> None:
        """The call's batch is validated: later calls may learn the rooms it creates."""
        if not self._creates.called:
            self._creates.callback(
                {ev.pdu.room_id: ev.pdu.room_version.identifier for ev in prepared if ev.pdu.is_create}
            )

    async def created_earlier(self, wanted: Collection[str] = ()) -> dict[str, str]:
        """Room ID -> version of the create events in the batches of the
        earlier calls still in flight, once each is validated: a batch naming
        such a room is validated by that version while the create event's
        write is still to come, instead of waiting for it. (Its own write
        comes after, and checks the room's stored version again.)

        ``wanted``: the rooms asked about. The calls are awaited in order
        only until each of them is found (the first create event is the one
        that counts): the calls validated after that one are not waited
        for, so the batches of an import's room created in flight are
        validated side by side, not one after another."""
        turns = self._turns._open
        created: dict[str, str] = {}
        missing = set(wanted)
        for earlier in turns[: turns.index(self)]:
            for room_id, version in (await _observed(earlier._creates)).items():
                created.setdefault(room_id, version)  # the first create event is the one that counts
                missing.discard(room_id)
            if wanted and not missing:
                break
        return created

    async def ready(self) -> None:
        if not self._ready:
            await _observed(self._before)
            self._ready = True

    def check_refused(self) -> None:
        """Raise the error an earlier call's write met that refuses this
        call's own (``WriteTurns.out_of_space``), if one did."""
        if self.refused is not None:
            raise type(self.refused)(*self.refused.args)

    def offer_batch(self, prepared: Sequence[PreparedEvent]) -> Offer:
        """Let an earlier call write ``prepared`` with its own (until ``withdraw``)."""
        self.offer = Offer(prepared)
        return self.offer

    def withdraw(self) -> None:
        """This call writes its batch itself: no other call may take it now."""
        self.offer = None

    def take_followers(self, room: int) -> list[Offer]:
        """The offers of the calls right after this one, in call order, up to
        ``room`` events in all; each marked taken (its call then waits for
        the outcome). Stops at the first later call without an offer (still
        validating, or writing alone): a batch never overtakes one before it."""
        turns = self._turns._open
        taken: list[Offer] = []
        for later in turns[turns.index(self) + 1 :]:
            offer = later.offer
            if offer is None or offer.taken or len(offer.prepared) > room:
                break
            offer.taken = True
            taken.append(offer)
            room -= len(offer.prepared)
        return taken

    def done(self) -> None:
        self.validated(())
        if not self._mine.called:
            self._turns.in_flight -= 1
            self._turns._open.remove(self)
            self._mine.callback(None)


def _refusal(exc: BaseException) -> bool:
    """Whether ``exc`` refuses a batch for what it holds (an underivable
    state, an invalid event), not for the database's state."""
    return isinstance(exc, (ValueError, LookupError)) and not isinstance(exc, DatabaseConfigError)


async def write_in_group(
    write: Callable[[list[PreparedEvent]], Awaitable[list]], prepared: Sequence[PreparedEvent], followers: list[Offer]
) -> list:
    """``write(prepared)`` and the followers' batches in one transaction when
    they go together; returns ``prepared``'s results, each follower's on its
    offer. Outcomes are those of one call at a time: a batch one of them
    refuses is written again call by call, each getting its own results or
    refusal; a database error fails every call of the group (nothing of any
    was written). A follower whose batch holds a prev event of an earlier
    batch's event (which then could not go first) is left to write alone."""
    groups = [list(prepared)]
    present = {ev.event_id for ev in prepared}
    needed = {p for ev in prepared for p in ev.pdu.prev_event_ids} - present
    for index, offer in enumerate(followers):
        if any(ev.event_id in needed for ev in offer.prepared):
            for released in followers[index:]:
                released.taken = False
            followers = followers[:index]
            break
        groups.append(offer.prepared)
        present.update(ev.event_id for ev in offer.prepared)
        needed.update(p for ev in offer.prepared for p in ev.pdu.prev_event_ids)
        needed -= present
    if len(groups) == 1:
        return await write(groups[0])
    try:
        try:
            results = await write([ev for group in groups for ev in group])
        except Exception as exc:
            if not _refusal(exc):
                raise
            return await _one_by_one(write, groups, followers)
    except BaseException:
        # However the group's write ended (a database error, a cancelled
        # call), no follower is left waiting: each gets the error.
        _fail_waiting(followers, Failure())
        raise
    start = len(groups[0])
    for offer, group in zip(followers, groups[1:], strict=True):
        offer.outcome.callback(results[start : start + len(group)])
        start += len(group)
    return results[: len(groups[0])]


def _fail_waiting(followers: list[Offer], failure: Failure) -> None:
    for offer in followers:
        if not offer.outcome.called:
            offer.outcome.errback(failure)


async def _one_by_one(write, groups: list[list[PreparedEvent]], followers: list[Offer]) -> list:
    own: list | None = None
    own_error: Failure | None = None
    try:
        own = await write(groups[0])
    except Exception:
        own_error = Failure()
    for offer, group in zip(followers, groups[1:], strict=True):
        try:
            offer.outcome.callback(await write(group))
        except Exception:
            offer.outcome.errback(Failure())
    if own_error is not None:
        own_error.raiseException()
    return own
