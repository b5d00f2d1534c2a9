"""Censoring: replacing a redacted event's stored bytes once retention passes.

A redacted event keeps its original bytes (``event_json.json``) for
``StoreConfig.redaction_retention_ms`` after its redaction was received, so
moderators can still see what was removed and a mistaken redaction can be
investigated; readers serve the pruned form in the meantime. After that the
bytes are replaced by the canonical JSON of ``prune_event_dict`` (the spec's
redaction algorithm, exactly what the event's reference hash and signatures
cover, so the censored event still verifies), ``event_json.censored`` is set
and the redaction's ``redactions.have_censored`` records that it has been
dealt with.

What counts, and why:

* only redactions whose target is stored, in the *same room*, and flagged
  ``events.redacted`` (the rule ``EventPersister.flag_redactions`` applies);
  a redaction from another room never censors anything;
* the clock starts when the *redaction* was received (``redactions.received_ts``),
  as in Synapse: a target that arrives after an old redaction is censored at
  the next run. "More than retention ago" is strict: a redaction received
  exactly ``retention`` ms ago is not yet due;
* redactions whose target is missing or elsewhere are left unmarked (their
  target may still arrive); the selection joins on the target, so they never
  hold back due rows behind them.

Who calls it: ``RoomStore.censor_expired_redactions`` (on demand) and the
periodic job ``RoomStore.open`` starts when ``StoreConfig.censor_interval_ms``
is set, both through the store's ``RedactionCensor``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from canonicaljson import encode_canonical_json
from twisted.internet import defer, task
from twisted.logger import Logger

from roomstore.events.tables.events import due_for_censoring_txn, mark_censored_txn, replace_json_txn
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import get_room_version
from roomstore.storage.database import Database, Transaction
from roomstore.storage.interning import Interners

log = Logger()

#: Redactions handled per transaction: bounds how long one transaction holds
#: its rows, and how many event bytes it has in memory.
BATCH_SIZE = 100


def pruned_json_bytes(room_version: str, raw: bytes) -> bytes:
    """The bytes a censored event is stored as: canonical JSON of the pruned PDU."""
    event = json.loads(bytes(raw).decode("utf-8"))
    return encode_canonical_json(prune_event_dict(get_room_version(room_version), event))


def censor_batch_txn(
    txn: Transaction,
    interners: Interners,
    invalidate_event: Callable[[str], None],
    cutoff_ts: int,
    limit: int = BATCH_SIZE,
) -> tuple[int, int]:
    """Censor the targets of up to ``limit`` due redactions (received before ``cutoff_ts``).

    Returns (redactions handled, events whose bytes were replaced). An event
    redacted several times is rewritten once; its later redactions are only
    marked. ``invalidate_event(event_id)`` runs after commit for each
    rewritten event (the event cache).
    """
    rows = due_for_censoring_txn(txn, cutoff_ts, limit)
    rewritten: dict[int, None] = {}
    for redaction_nid, target_nid, room_version, raw, censored in rows:
        if not censored and target_nid not in rewritten:
            replace_json_txn(txn, target_nid, pruned_json_bytes(room_version, raw), True)
            rewritten[target_nid] = None
        mark_censored_txn(txn, redaction_nid)
    if rewritten:
        event_ids = interners.events.resolve(txn, list(rewritten))
        for event_id in event_ids.values():
            txn.call_after(invalidate_event, event_id)
    return len(rows), len(rewritten)


class RedactionCensor:
    """Censors redacted events whose redaction is older than the retention,
    on demand (``censor_expired``) or every ``interval_ms`` (``start``).

    Collaborators: the database, the interners, ``invalidate_event`` (drops
    an event from the event cache: ``StoreCaches.event_changed``), the retention
    (``StoreConfig.redaction_retention_ms``) and ``clock``: anything with
    ``seconds()`` and ``callLater`` (the reactor, or a
    ``twisted.internet.task.Clock`` in tests); "now" is ``clock.seconds()``.
    The periodic job logs a failed run and still runs the next one;
    ``stop()`` waits for a run in progress, so the store can close its
    database after it.
    """

    def __init__(
        self, db: Database, interners: Interners, invalidate_event: Callable[[str], None], retention_ms: int, clock: Any
    ):
        self.db = db
        self.interners = interners
        self.invalidate_event = invalidate_event
        self.retention_ms = retention_ms
        self.clock = clock
        self.interval_ms: int | None = None
        self.runs = 0
        self.censored = 0
        self._loop = task.LoopingCall(self._run)
        self._loop.clock = clock
        self._in_progress: defer.Deferred | None = None

    async def censor_expired(self, now_ms: int | None = None) -> int:
        """Censor every redacted event whose redaction is older than the retention.

        ``now_ms`` defaults to the clock's now (``redactions.received_ts``
        comes from the same clock). Runs in transactions of ``BATCH_SIZE``
        redactions until none is due; returns the number of events censored.
        """
        if now_ms is None:
            now_ms = int(self.clock.seconds() * 1000)
        cutoff = now_ms - self.retention_ms
        total = 0
        while True:
            handled, censored = await self.db.run_interaction(
                "censor_expired_redactions",
                censor_batch_txn,
                self.interners,
                self.invalidate_event,
                cutoff,
                BATCH_SIZE,
            )
            total += censored
            if handled < BATCH_SIZE:
                return total

    def start(self, interval_ms: int) -> None:
        """Run every ``interval_ms``; the first run waits one interval, so
        opening a store does not start with a database scan."""
        if interval_ms <= 0:
            raise ValueError("censor_interval_ms must be positive")
        self.interval_ms = interval_ms
        self._loop.start(interval_ms / 1000, now=False)

    async def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()
        await self.wait_idle()

    async def wait_idle(self) -> None:
        """Return once no run is in progress (tests advance a Clock, then wait)."""
        while self._in_progress is not None:
            await self._in_progress

    def _run(self) -> defer.Deferred:
        d = defer.ensureDeferred(self.run_once())
        if not d.called:
            self._in_progress = d

            def done(result):
                if self._in_progress is d:
                    self._in_progress = None
                return result

            d.addBoth(done)
        return d

    async def run_once(self) -> int:
        """One run at the clock's now; returns the number censored (0 on failure)."""
        try:
            count = await self.censor_expired()
        except Exception:
            log.failure("censoring expired redactions failed; trying again in {interval} ms", interval=self.interval_ms)
            return 0
        finally:
            self.runs += 1
        self.censored += count
        return count
