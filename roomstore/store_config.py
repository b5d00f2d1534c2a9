"""``StoreConfig``: how a store process is set up (``RoomStore.open``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from roomstore.state.groups import DEFAULT_MAX_CHAIN_LENGTH
from roomstore.storage.embedder_schema import EmbedderSchema, distinct_names
from roomstore.streams.builtin import BUILTIN_STREAMS


def _schema_tuple(schemas: Iterable[EmbedderSchema]) -> tuple[EmbedderSchema, ...]:
    return tuple(schemas)


DAY_MS = 24 * 3600 * 1000


@attrs.frozen
class StoreConfig:
    """How a store process is set up.

    ``stream_writers`` maps a stream name to its writer instances (default:
    this instance writes every stream). ``token_wait_ms``: how long a read
    waits for a token ahead of this process's stream positions (a worker
    behind its writer) before refusing it. ``redaction_retention_ms``: how long
    a redacted event's original bytes stay retrievable before the censor job
    replaces them. ``censor_interval_ms``: how often that job runs (None: never
    on its own; ``RoomStore.censor_expired_redactions`` still works).
    """

    instance_name: str = "master"
    stream_writers: Mapping[str, Sequence[str]] = attrs.field(factory=dict)
    max_state_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH
    event_cache_size: int = 10_000
    change_cache_size: int = 100_000
    redaction_retention_ms: int = 7 * DAY_MS
    censor_interval_ms: int | None = None
    #: How long a read given a token ahead of this process's position waits
    #: for it (a worker behind its writer) before refusing it as invalid.
    token_wait_ms: int = 5_000
    #: Read only: persist nothing and take no writer lock, so it runs beside
    #: a live writer (the read commands). Otherwise a process writing a
    #: stream holds its instance's writer lock (``storage.writer_lock``).
    read_only: bool = False
    #: Worker processes that validate ``persist_events``' batches of 25
    #: events or more, on other cores (``events/write/pipeline.py``); 0: the
    #: validator's one thread validates every batch (no child processes).
    #: Opt-in: with several calls in flight, one worker doubles a writer's
    #: throughput on this project's 2-core machines, and raises its reactor's
    #: lateness (``bench/event_store.py`` (a) and (f); docs/benchmarks.md).
    validation_processes: int = 0
    #: Group commit: calls validated while an earlier one writes go into its
    #: transaction, up to this many events in all (1: every call alone).
    max_events_per_transaction: int = attrs.field(default=1_000, validator=attrs.validators.ge(1))
    #: Write in a child process (``writer_process/parent.py``): the writes
    #: (``persist_events``, ``invalidate_cache``, ``censor_expired_redactions``,
    #: ``delete_state_groups``) go to a process of their own, which holds the
    #: writer lock, validates and writes; this process reads, and learns each
    #: committed batch from its replies. Keeps a fast import's Python off
    #: this process's GIL and cores, so its reactor stays on time. Needs a
    #: database URL naming a file or a server (not ``:memory:``).
    writer_process: bool = False
    #: The child writer's CPU priority: ``"idle"`` (Linux ``SCHED_IDLE``: it
    #: runs when nothing else of normal priority wants the core; nice 19
    #: where that is refused) or a nice value 0-19 (never below this
    #: process's own). Its validation workers inherit it.
    writer_process_priority: str | int = attrs.field(default="idle")
    #: The child writer's cyclic garbage collector once its store is open:
    #: what start-up made frozen out of every collection (``gc.freeze``) and
    #: these thresholds (``gc.set_threshold``); None leaves Python's. A bulk
    #: load sets them (``roomstore.processes.BULK_GC_THRESHOLDS``): the
    #: child is the store's own process, nothing else runs in it.
    writer_process_gc: tuple[int, int, int] | None = attrs.field(default=None)
    #: The least level of the child writer's log lines on stderr
    #: (``twisted.logger.LogLevel`` names: debug, info, warn, error, critical).
    writer_process_log_level: str = attrs.field(
        default="info", validator=attrs.validators.in_(("debug", "info", "warn", "error", "critical"))
    )
    #: The embedding program's own schemas (``roomstore.storage.embedder_schema``):
    #: migrated after the store's, in its transaction; checked, never migrated,
    #: by a read-only store.
    embedder_schemas: Sequence[EmbedderSchema] = attrs.field(
        default=(), converter=_schema_tuple, validator=distinct_names
    )
    #: This homeserver's server name: ``RoomStore.purge_history`` keeps the
    #: events of its users (senders ``@...:server_name``) unless told to
    #: delete local events too. None: the store knows no server of its own,
    #: so no event is local and ``delete_local_events`` changes nothing.
    server_name: str | None = None

    @writer_process_priority.validator
    def _check_priority(self, _attribute, value) -> None:
        if value != "idle" and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 19):
            raise ValueError(f"writer_process_priority must be 'idle' or a nice value 0-19, not {value!r}")

    @writer_process_gc.validator
    def _check_gc(self, _attribute, value) -> None:
        if value is not None and (
            not isinstance(value, tuple)
            or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        ):
            raise ValueError(f"writer_process_gc must be None or three thresholds (ints, 0 or more), not {value!r}")

    def writes_anything(self) -> bool:
        """Whether this process is a writer of any built-in stream."""
        if self.read_only:
            return False
        return any(
            self.instance_name in self.stream_writers.get(name, [self.instance_name]) for name in BUILTIN_STREAMS
        )
