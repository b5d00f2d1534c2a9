"""One live process per writer instance.

Stream positions are recovered at start-up on the assumption that nothing of
this instance is in flight; two live processes claiming one writer instance
would break that (and, on SQLite, hand out the same stream IDs twice). So a
process that writes takes a lock for its whole life:

- PostgreSQL: a *session* advisory lock keyed by the instance name, on a
  connection of its own that stays open while the process runs. The server
  releases it when that connection goes, also when the process is killed.
  The connection's ``application_name`` names the holder (pid and host), so a
  refused process can say who holds it.
- SQLite: the file has one writer process, whatever its instance name (IDs
  are counted in-process): an exclusive ``flock`` on ``<file>.writer-lock``
  beside the database, whose content names the holder. The kernel releases it
  when the process dies.

``await WriterLock.acquire(db, instance_name)`` returns the held lock or
raises :class:`WriterLockHeld` (one line: the instance, the holder, what to
do); ``await lock.release()`` lets it go. Read-only processes take no lock.

A session lock dies with its session: a PostgreSQL restart, or
``pg_terminate_backend`` of the lock's connection, frees it. ``lock.watch(clock)``
checks the session every ``CHECK_INTERVAL_S`` (and when the pool's outage
ends); finding it gone, it reconnects and takes the lock again (a warning
line says so), or, if another process took it meanwhile, gives up: an error
line names the holder and ``lost`` fires with :class:`WriterLockLost`, which
the store raises from then on and the services stop on.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from typing import Any

from twisted.logger import Logger

from roomstore.storage.errors import DatabaseConfigError
from roomstore.storage.pg_connection import (
    advisory_lock_holder,
    advisory_unlock,
    holds_advisory_lock,
    try_advisory_lock,
)
from roomstore.storage.sqlite_connection import cannot_open

__all__ = ["WriterLock", "WriterLockHeld", "WriterLockLost", "writer_lock_key"]

log = Logger()

#: First key of the two-int4 advisory lock: 'rsWL'. The second is the CRC-32
#: of the instance name, so every instance has its own lock.
_LOCK_CLASS = 0x7273574C - (1 << 32) if 0x7273574C >= 1 << 31 else 0x7273574C
#: application_name prefix of a lock holder's connection.
_APP_PREFIX = "roomstore-writer"


class WriterLockHeld(DatabaseConfigError):
    """Another live process already is this writer instance."""


class WriterLockLost(DatabaseConfigError):
    """The lock went with the database connection and another process holds
    it now: this process must stop writing as the instance."""


#: How often a held PostgreSQL lock's session is checked (seconds).
CHECK_INTERVAL_S = 1.0


def writer_lock_key(instance_name: str) -> tuple[int, int]:
    """The (int4, int4) advisory lock key of ``instance_name``."""
    crc = zlib.crc32(instance_name.encode("utf-8"))
    return _LOCK_CLASS, crc - (1 << 32) if crc >= 1 << 31 else crc


def _holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _refusal(instance_name: str, where: str, holder: str) -> str:
    return (
        f"writer instance {instance_name!r} is already running ({holder}) on {where}: stop that process first,"
        " run this one under another --instance listed in --stream-writers (PostgreSQL with --redis),"
        " or use a read-only command (state, messages, sync, recent, stats)"
    )


class WriterLock:
    """A held writer lock; see the module docstring."""

    def __init__(self, db: Any, instance_name: str, resource: Any, release_fn: Any):
        self.db = db
        self.instance_name = instance_name
        self._resource = resource
        self._release_fn = release_fn
        #: Fires with a WriterLockLost (as its result, not an error) if the
        #: lock is lost for good; see the module docstring.
        self.lost: Any = None
        self.retaken = 0
        self._watcher: Any = None
        self._checking = False
        #: The check running now, if any: ``release`` waits for it, as the two
        #: would use the lock's session connection from two threads at once.
        self._in_flight: Any = None

    def watch(self, clock: Any, interval_s: float = CHECK_INTERVAL_S) -> None:
        """Check the lock's session every ``interval_s`` and after each
        outage of the pool (PostgreSQL; a no-op elsewhere)."""
        from twisted.internet import defer, task

        self.lost = defer.Deferred()
        if self._release_fn is not _pg_release:
            return
        self._watcher = task.LoopingCall(self.check)
        self._watcher.clock = clock
        self._watcher.start(interval_s, now=False)
        self.db.outages.on_end.append(self.check)

    def check(self) -> Any:
        """Check the lock now (returns a Deferred, or None if a check is running)."""
        from twisted.internet import defer

        if self._checking or self._resource is None or self.db.closed or (self.lost and self.lost.called):
            return None
        self._checking = True
        d = defer.ensureDeferred(self._check())

        def done(result: Any) -> Any:
            self._checking = False
            self._in_flight = None
            return result

        self._in_flight = d
        return d.addBoth(done)

    async def _check(self) -> None:
        resource = self._resource
        try:
            outcome, detail = await self.db.run_blocking(_pg_recheck, self.db.engine, resource)
        except Exception as exc:  # the database is not back yet: the next check
            log.info("writer lock of {instance}: check failed ({exc})", instance=self.instance_name, exc=exc)
            return
        if outcome == "held":
            return
        if outcome == "retaken":
            if self._resource is None:  # released meanwhile: let the new one go too
                await self.db.run_blocking(_pg_release, (detail, self.instance_name))
                return
            self.retaken += 1
            self._resource = (detail, self.instance_name)
            log.warn(
                "writer lock of instance {instance!r} went with its database session (the server restarted"
                " or ended the session); taken again, on a new session",
                instance=self.instance_name,
            )
            return
        if outcome == "down":
            return
        # Taken by another process while ours was gone.
        self._resource = None
        if self._watcher is not None and self._watcher.running:
            self._watcher.stop()
        error = WriterLockLost(
            f"writer instance {self.instance_name!r} lost its lock with its database session, and another process"
            f" took it meanwhile ({detail}): stopping, since two processes must never write as one instance"
        )
        log.error("{error}", error=str(error))
        if self.lost is not None and not self.lost.called:
            self.lost.callback(error)

    @classmethod
    async def acquire(cls, db: Any, instance_name: str) -> WriterLock:
        """Take the lock of ``instance_name`` on ``db``'s database, or raise WriterLockHeld."""
        if not db.engine.single_writer:
            conn = await db.run_blocking(_pg_acquire, db.engine, instance_name)
            return cls(db, instance_name, (conn, instance_name), _pg_release)
        # One writer process per database file, whatever its instance name.
        path = db.engine.path
        if path == ":memory:":
            # Nobody else can open an in-memory database.
            return cls(db, instance_name, None, None)
        handle = await db.run_blocking(_sqlite_acquire, path, instance_name, db.engine.describe())
        return cls(db, instance_name, handle, _sqlite_release)

    async def release(self) -> None:
        """Let the lock go (idempotent), once a check in progress has ended."""
        from twisted.internet import defer

        if self._watcher is not None and self._watcher.running:
            self._watcher.stop()
        outages = getattr(self.db, "outages", None)
        if outages is not None and self.check in outages.on_end:
            outages.on_end.remove(self.check)
        if self._in_flight is not None:
            ended: Any = defer.Deferred()
            self._in_flight.addBoth(lambda result: (ended.callback(None), result)[1])
            await ended
        resource, self._resource = self._resource, None
        if resource is not None and self._release_fn is not None:
            await self.db.run_blocking(self._release_fn, resource)


# ---------------------------------------------------------------- PostgreSQL


#: How long a claim waits for the server to end the session of a holder that
#: is a dead process on this host (killed a moment ago, its lock not yet freed).
DEAD_HOLDER_WAIT_S = 10.0


def _pg_acquire(engine: Any, instance_name: str) -> Any:
    # application_name is at most 63 bytes; keep the pid and host readable.
    app_name = f"{_APP_PREFIX} {os.getpid()}@{socket.gethostname()}"[:63]
    conn = engine.session_connection(app_name)
    deadline = time.monotonic() + DEAD_HOLDER_WAIT_S
    try:
        with conn.cursor() as cur:
            while True:
                if try_advisory_lock(cur, writer_lock_key(instance_name)):
                    return conn
                row = advisory_lock_holder(cur, writer_lock_key(instance_name))
                if row is None and time.monotonic() < deadline:
                    continue  # released between the two statements: claim it again
                # A writer restarted right after being killed can find its
                # predecessor's session not yet ended by the server: wait for
                # it, but only when the holder is provably dead (its pid on
                # this very host no longer exists), and not for long.
                if not (row and _is_dead_local_holder(row[0])) or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
    except BaseException:
        conn.close()
        raise
    conn.close()
    holder = "holder unknown"
    if row is not None:
        app, addr, started = row
        named = _holder_of(app)
        if named is None:  # another program's session: its application_name as it is
            pid, _, host = (app or "?").partition("@")
        else:
            pid, host = named
        holder = f"pid {pid} on {host or addr or '?'}, since {started:%Y-%m-%d %H:%M:%S %Z}".rstrip()
    raise WriterLockHeld(_refusal(instance_name, engine.describe(), holder))


def _pg_recheck(engine: Any, held: tuple[Any, ...]) -> tuple[str, Any]:
    """("held", None) while the session holds the lock; else reconnects and
    takes it again: ("retaken", new connection), ("taken", holder text) if
    another session has it, ("down", None) if the server is not back yet."""
    conn, instance_name = held[0], held[1]
    try:
        with conn.cursor() as cur:
            if holds_advisory_lock(cur, writer_lock_key(instance_name)):
                return "held", None
            # The session lives but the lock is gone (unlocked by hand): take it again below.
    except Exception:
        pass
    try:
        conn.close()
    except Exception:
        pass
    app_name = f"{_APP_PREFIX} {os.getpid()}@{socket.gethostname()}"[:63]
    try:
        new = engine.session_connection(app_name)
    except Exception:
        return "down", None
    try:
        with new.cursor() as cur:
            if try_advisory_lock(cur, writer_lock_key(instance_name)):
                return "retaken", new
            row = advisory_lock_holder(cur, writer_lock_key(instance_name))
    except Exception:
        new.close()
        return "down", None
    new.close()
    if row is None:
        return "down", None  # released between the two statements: try again next time
    named = _holder_of(row[0])
    pid, host = named if named is not None else ((row[0] or "?"), "")
    return "taken", f"pid {pid} on {host or row[1] or '?'}"


def _holder_of(application_name: str | None) -> tuple[str, str] | None:
    """(pid, host) named by a lock holder's application_name (``_pg_acquire``
    sets it), or None for a session that is not a roomstore writer's."""
    if not application_name or not application_name.startswith(_APP_PREFIX):
        return None
    pid, _, host = application_name[len(_APP_PREFIX) :].strip().partition("@")
    return pid, host


def _is_dead_local_holder(application_name: str | None) -> bool:
    """True when a holder's application_name names a pid on this host that no longer exists."""
    pid_text, host = _holder_of(application_name) or ("", "")
    # application_name is cut at 63 bytes: a cut host name never matches.
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, someone else's
    return False


def _pg_release(held: tuple[Any, str]) -> None:
    conn, instance_name = held
    try:
        # Unlocked before closing: the server ends a closed session a moment
        # later, and a successor starting at once must find the lock free.
        with conn.cursor() as cur:
            advisory_unlock(cur, writer_lock_key(instance_name))
    except Exception:
        pass
    finally:
        conn.close()


# ---------------------------------------------------------------- SQLite


def _sqlite_acquire(path: str, instance_name: str, where: str) -> Any:
    import fcntl

    lock_path = os.path.abspath(path) + ".writer-lock"
    try:
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        handle = open(lock_path, "a+", encoding="utf-8")
    except OSError as exc:
        raise cannot_open(path, exc) from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "holder unknown"
        handle.close()
        raise WriterLockHeld(_refusal(instance_name, where, holder)) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"instance {instance_name!r}, {_holder_text()}\n")
    handle.flush()
    return handle


def _sqlite_release(handle: Any) -> None:
    import fcntl

    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()
