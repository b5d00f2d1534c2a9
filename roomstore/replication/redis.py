"""Replication over Redis pub/sub: every process of a deployment on one bus.

Beside direct TCP (one server, its workers), processes can meet on a Redis
server, the way Synapse deployments do. The lines are the TCP protocol's
(``roomstore.replication.commands``), published on two channels:

- ``<channel>`` (the homeserver's name by default): what every process hears:
  ``REPLICATE``, ``POSITION``, ``RDATA``;
- ``<channel>/<instance>``: commands aimed at one process (a reader that
  needs a writer's position sends that writer ``REPLICATE`` there).

What each process does (:class:`RedisReplication`, one per process, writer or
reader alike):

- on (re)connect, once both its publishing and its subscribed connection are
  up, it publishes ``REPLICATE``, and, for every stream it writes,
  ``POSITION <stream> <self> <p> <p>`` with ``p`` its current position (its
  generator's, which may be past the rows it has published); it answers
  every ``REPLICATE`` the same way;
- as its own position in a stream moves, it reads the new rows from the
  database (the stream's ``get_updates``, in pages, the next page read while
  one is published) and publishes them as ``RDATA`` (all but the last row of
  a token with ``batch``), then ``POSITION`` if the position went past the
  last row: a page's lines pipelined, in one write and one round trip;
- it ignores lines about itself, and applies the other writers' lines through
  a :class:`~roomstore.replication.follower.StreamFollower`: a ``POSITION``
  whose ``prev_token`` is ahead of what it applied makes it fill the gap from
  the shared database through the stream's ``get_updates`` in bounded pages,
  reading the next page while it applies one (there is no HTTP side channel); ``RDATA`` of a writer is only applied once
  a ``POSITION`` of that writer arrived on the current connection, so rows
  published while it was away are never skipped over.

Positions are tracked per writer (``StreamPositions``, and the store's ID
generators, whose linear position is the minimum over the stream's listed
writers, so it never passes a writer that has not been heard from).

The Redis client is ``txredisapi`` (what Synapse uses: maintained, a plain
Twisted protocol, reconnects with back-off through ``ClientService``), with
``hiredis`` as its reply parser (its pure-Python one took nearly half of a
reader's time per line in ``bench/replication.py``).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import txredisapi
from twisted.internet import defer
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.logger import Logger

from roomstore.replication import metrics
from roomstore.replication.commands import (
    CommandParseError,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    parse_command_from_line,
    parse_rdata_fields,
    serialize_command,
)
from roomstore.replication.dispatch import CloseConnection
from roomstore.replication.follower import StreamFollower, StreamPositions
from roomstore.replication.store_handler import StoreReplicationHandler
from roomstore.replication.store_streams import STORE_STREAMS, wire_server
from roomstore.replication.tls import ClientTLS
from roomstore.replication.wire import encode_fast
from roomstore.storage.collector import collector_paused

__all__ = ["RedisAddress", "RedisRefused", "RedisReplication", "parse_redis_url", "shown_url"]

log = Logger()


@attrs.frozen
class RedisAddress:
    host: str
    port: int = 6379
    dbid: int | None = None
    password: str | None = attrs.field(default=None, repr=False)
    #: ``rediss://``: TLS to the server.
    tls: bool = False

    def describe(self) -> str:
        """The URL without the password."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}" + (f"/{self.dbid}" if self.dbid is not None else "")


def parse_redis_url(url: str) -> RedisAddress:
    """``redis[s]://[:password@]host[:port][/db]`` (``rediss``: over TLS);
    raises ValueError with what to write (never repeating the password)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        shown = url if parsed.password is None else url.replace(parsed.password, "***")
        raise ValueError(f"Redis URL {shown!r} is not of the form redis://[:PASSWORD@]host:port or rediss://...")
    try:
        port = parsed.port or 6379
        path = parsed.path.strip("/")
        dbid = int(path) if path else None
    except ValueError:
        raise ValueError(f"Redis URL {parsed.hostname}: bad port or database number") from None
    password = urllib.parse.unquote(parsed.password) if parsed.password is not None else None
    return RedisAddress(parsed.hostname, port, dbid, password, parsed.scheme == "rediss")


def shown_url(url: str) -> str:
    """A Redis URL as a message may show it: without its password."""
    try:
        return parse_redis_url(url).describe()
    except ValueError:
        return "the Redis URL"


class RedisRefused(RuntimeError):
    """The Redis server refused our password (or database number)."""


class _Reporting:
    """Tells the owner when the factory's one connection comes and goes."""

    initialDelay = 0.2
    maxDelay = 2.0
    role = ""

    def addConnection(self, conn: Any) -> None:
        super().addConnection(conn)  # type: ignore[misc]
        if conn in self.pool:  # type: ignore[attr-defined]
            self.owner._connection_up(self.role, conn)  # type: ignore[attr-defined]

    def delConnection(self, conn: Any) -> None:
        super().delConnection(conn)  # type: ignore[misc]
        self.owner._connection_down(self.role, conn)  # type: ignore[attr-defined]

    def connectionError(self, why: str) -> None:
        # txredisapi gave up: AUTH or SELECT refused (it stops retrying).
        super().connectionError(why)  # type: ignore[misc]
        self.owner._connection_refused(why)  # type: ignore[attr-defined]


class _TLSEndpoint:
    """TLS over another client endpoint, handing the Redis protocol (not the
    TLS wrapper) to txredisapi's connection slots."""

    def __init__(self, wrapped: Any, options: Any) -> None:
        self.wrapped = wrapped
        self.options = options

    def connect(self, factory: Any) -> defer.Deferred:
        from twisted.protocols.tls import TLSMemoryBIOFactory

        d = self.wrapped.connect(TLSMemoryBIOFactory(self.options, True, factory))
        return d.addCallback(lambda protocol: protocol.wrappedProtocol)


class _PublisherProtocol(txredisapi.RedisProtocol):
    def publish_many(self, channel: str, messages: list[str]) -> defer.Deferred | None:
        """``PUBLISH channel message`` for each of ``messages``, pipelined:
        every command in one transport write, one round trip for all.
        Fires with the last reply (Redis answers in order, so every one has
        then arrived); None if the connection is gone."""
        if not self.connected or not messages:
            return None
        name = channel.encode("utf-8")
        head = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n" % (len(name), name)
        parts: list[bytes] = []
        for message in messages:
            data = message.encode("utf-8")
            parts += (head, b"$%d\r\n" % len(data), data, b"\r\n")
        self.transport.write(b"".join(parts))
        # One reply per command, consumed in order as txredisapi's own
        # commands consume theirs (an error reply is a value here, not a failure).
        get = self.replyQueue.get
        last = None
        for _ in messages:
            last = get()
        return last


class _Publisher(_Reporting, txredisapi.RedisFactory):
    """One connection for PUBLISH."""

    protocol = _PublisherProtocol
    role = "publish"

    def __init__(self, owner: RedisReplication, address: RedisAddress):
        txredisapi.RedisFactory.__init__(
            self, address.describe(), address.dbid, 1, isLazy=True, password=address.password, convertNumbers=False
        )
        self.owner = owner
        self.deferred.addErrback(lambda f: None)  # a refusal is reported through the owner


class _SubscriberProtocol(txredisapi.SubscriberProtocol):
    def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
        self.factory.owner._on_message(channel, message)


class _Subscriber(_Reporting, txredisapi.SubscriberFactory):
    """One subscribed connection."""

    protocol = _SubscriberProtocol
    role = "subscribe"

    def __init__(self, owner: RedisReplication, address: RedisAddress):
        txredisapi.RedisFactory.__init__(
            self, address.describe(), address.dbid, 1, isLazy=True, password=address.password, convertNumbers=False
        )
        self.owner = owner
        self.deferred.addErrback(lambda f: None)  # a refusal is reported through the owner


def _rdata_lines(stream_name: str, instance_name: str, updates: list[tuple[int, Any]]) -> list[str]:
    """The RDATA lines of a page of ``(token, row)`` (``serialize_command``'s
    lines, built without a command object per row): all but the last row of
    a token carry ``batch``."""
    if not updates:
        return []
    prefix = f"RDATA {stream_name} {instance_name} "
    try:
        encoded = [encode_fast(row) for _, row in updates]
    except (TypeError, ValueError, RecursionError):
        # The command reports what is wrong with the row.
        encoded = [RdataCommand(stream_name, instance_name, 0, row).row_json for _, row in updates]
    tokens = [token for token, _ in updates]
    following: list[int | None] = [*tokens[1:], None]
    return [
        f"{prefix}{'batch' if token == after else token} {row_json}"
        for token, after, row_json in zip(tokens, following, encoded, strict=True)
    ]


def _drop_read(ahead: tuple[int, defer.Deferred] | None) -> None:
    """A page read ahead that will not be used: its failure is nobody's."""
    if ahead is not None:
        ahead[1].addErrback(lambda f: None)


class RedisReplication:
    """This process on the Redis bus: announces what it writes, applies what others write.

    ``store``: the process's ``RoomStore`` (its generators say which streams
    it writes and who the writers are). ``handler``: applies other writers'
    rows (default: a ``StoreReplicationHandler`` calling ``on_applied``).
    ``positions``: where this process has applied each ``(stream, writer)``
    (default: the store's positions at start). ``replay_from``: per stream
    this process writes, announce its rows from this token on the first
    connect rather than from its position (benchmarks, or sending a history
    to new followers as RDATA). Call :meth:`start`, and
    ``await`` :meth:`stop` at the end. From the reactor thread only.
    """

    def __init__(
        self,
        store: Any,
        address: RedisAddress,
        channel: str,
        *,
        reactor: Any = None,
        handler: StoreReplicationHandler | None = None,
        on_applied: Callable[[str, str, int, list], Any] | None = None,
        positions: StreamPositions | None = None,
        page_size: int = 500,
        replay_from: dict[str, int] | None = None,
        tls: ClientTLS | None = None,
    ):
        if not channel or any(c.isspace() for c in channel):
            raise ValueError(f"Redis channel {channel!r} must be a non-empty word")
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.store = store
        self.address = address
        # rediss:// without files: the system's trusted roots.
        self.tls = tls if tls is not None else (ClientTLS() if address.tls else None)
        self.refused: str | None = None
        self.channel = channel
        self.instance_name = store.instance_name
        self.instance_channel = f"{channel}/{self.instance_name}"
        self.reactor = reactor
        self.page_size = page_size
        self.handler = handler or StoreReplicationHandler(store, on_applied=on_applied)
        self.streams = self.handler.streams
        if positions is None:
            positions = self.handler.initial_positions()
        self.positions = positions
        # Filling from the database, the next page is read while one is
        # applied: 2 reads in flight (on a one-connection pool, SQLite's, the
        # second waits for the first and is then read, without the GIL,
        # while the reactor applies the first).
        self.follower = StreamFollower(
            self.handler, positions, page_size=page_size, follow_moves_back=False, read_ahead=2
        )
        #: Streams this process writes, and the last token announced in each.
        self.own_streams = [n for n in STORE_STREAMS if store.stream(n).is_writer]
        self._announced = {
            n: store.stream(n).get_current_token_for_writer(self.instance_name) for n in self.own_streams
        }
        self._replay = dict(replay_from or {})
        self._announcing: set[str] = set()
        self._announce_again: set[str] = set()
        self._idle_waiters: list[defer.Deferred] = []
        self._pub_conn: Any = None
        self._sub_conn: Any = None
        self._subscribed = False
        self.ready = False
        self._ready_waiters: list[defer.Deferred] = []
        #: ``(stream, writer)`` heard with POSITION since the last (re)connect.
        self._synced: set[tuple[str, str]] = set()
        self._asked: set[str] = set()
        self._publisher: _Publisher | None = None
        self._subscriber: _Subscriber | None = None
        self._unwire: Callable[[], None] | None = None
        self._stopped = False
        self._received_rdata = metrics.REDIS_RECEIVED.labels("RDATA")

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Connect (and keep reconnecting) both connections."""
        self._publisher = _Publisher(self, self.address)
        self._subscriber = _Subscriber(self, self.address)
        options = self.tls.options(self.address.host) if self.tls is not None else None
        for factory in (self._publisher, self._subscriber):
            endpoint: Any = TCP4ClientEndpoint(self.reactor, self.address.host, self.address.port)
            if options is not None:
                endpoint = _TLSEndpoint(endpoint, options)
            factory.startConnecting(endpoint)
        self._unwire = wire_server(self.store, self._stream_advanced)
        log.info(
            "redis replication: {instance} on {address}, channel {channel}",
            instance=self.instance_name,
            address=self.address.describe(),
            channel=self.channel,
        )

    def when_ready(self) -> defer.Deferred:
        """Fires once both connections are up and REPLICATE went out; fails
        with ``RedisRefused`` if the server refused our password."""
        if self.ready:
            return defer.succeed(None)
        if self.refused is not None:
            return defer.fail(RedisRefused(self.refused))
        d: defer.Deferred = defer.Deferred()
        self._ready_waiters.append(d)
        return d

    async def flush(self) -> None:
        """Wait until everything this process wrote so far is published
        (waits for a connection if there is none)."""
        while True:
            if not self.ready:
                await self.when_ready()
                continue
            pending = [
                n
                for n in self.own_streams
                if self._announced[n] < self.store.stream(n).get_current_token_for_writer(self.instance_name)
                or n in self._announcing
            ]
            if not pending:
                return
            for name in pending:
                self._schedule_announce(name)
            d: defer.Deferred = defer.Deferred()
            self._idle_waiters.append(d)
            await d

    async def stop(self) -> None:
        """Stop announcing and applying; close both connections."""
        self._stopped = True
        if self._unwire is not None:
            self._unwire()
        self.follower.stop()
        for factory in (self._publisher, self._subscriber):
            if factory is not None:
                try:
                    await factory.disconnect()
                except Exception:
                    pass
        self._set_ready(False)

    # ------------------------------------------------------------------ connections

    def _connection_up(self, role: str, conn: Any) -> None:
        metrics.REDIS_CONNECTED.labels(role).set(1)
        if role == "publish":
            self._pub_conn = conn
            self._check_ready()
            return
        self._sub_conn = conn
        d = conn.subscribe([self.channel, self.instance_channel])

        def subscribed(_: Any) -> None:
            if conn is self._sub_conn:
                self._subscribed = True
                self._check_ready()

        def failed(f: Any) -> None:
            if "NOAUTH" in f.getErrorMessage():  # the server needs a password we did not give
                self._connection_refused(f.getErrorMessage())
            else:
                log.warn("redis SUBSCRIBE failed: {f}", f=f.getErrorMessage())

        d.addCallbacks(subscribed, failed)

    def _connection_refused(self, why: str) -> None:
        if self.refused is not None:
            return
        reason = why.removeprefix("Redis error: ")
        self.refused = (
            f"Redis at {self.address.describe()} refused the connection ({reason});"
            " check the password in the URL (redis://:PASSWORD@host:port)"
        )
        waiters, self._ready_waiters = self._ready_waiters, []
        if not waiters:  # a waiter (the import command) says it itself, once
            log.error("redis replication: {reason}", reason=self.refused)
        for d in waiters:
            d.errback(RedisRefused(self.refused))

    def _connection_down(self, role: str, conn: Any) -> None:
        if conn not in (self._pub_conn, self._sub_conn):
            return
        metrics.REDIS_CONNECTED.labels(role).set(0)
        if role == "publish":
            self._pub_conn = None
        else:
            self._sub_conn = None
            self._subscribed = False
        # Lines were lost while this connection was down: nobody's RDATA is
        # applied again until a POSITION of the new session. (The subscribed
        # connection can be back before the publishing one, i.e. before the
        # new session's REPLICATE; RDATA heard then must not pass a gap.)
        self._synced.clear()
        self.follower.drop_partial_batches()
        self._set_ready(False)

    def _check_ready(self) -> None:
        if self._stopped or self.ready or self._pub_conn is None or not self._subscribed:
            return
        self._set_ready(True)
        # A new session: lines may have been lost while we were away, ours
        # and theirs. Nobody's RDATA is applied again until its POSITION.
        self._synced.clear()
        self._asked.clear()
        self.follower.drop_partial_batches()
        self._publish(ReplicateCommand())
        defer.ensureDeferred(self._catch_up_from_database()).addErrback(
            lambda f: log.failure("redis replication: catching up from the database failed", f)
        )
        for name in self.own_streams:
            if name in self._replay:
                self._announced[name] = self._replay.pop(name)
                self._publish_position(name)
            else:
                self._publish_current_position(name)
            self._schedule_announce(name)
        log.info("redis replication: connected to {address}", address=self.address.describe())
        waiters, self._ready_waiters = self._ready_waiters, []
        for d in waiters:
            d.callback(None)

    def _set_ready(self, ready: bool) -> None:
        if self.ready and not ready and not self._stopped:
            log.warn(
                "redis replication: lost the connection to {address}; reconnecting", address=self.address.describe()
            )
        self.ready = ready

    # ------------------------------------------------------------------ publishing

    def _publish(self, cmd: Any, channel: str | None = None) -> defer.Deferred | None:
        conn = self._pub_conn
        if conn is None or not self.ready:
            return None
        d = conn.publish(channel or self.channel, serialize_command(cmd))
        metrics.REDIS_PUBLISHED.labels(cmd.NAME).inc()
        d.addErrback(lambda f: None)  # the connection went; reconnecting re-announces
        return d

    def _publish_position(self, name: str) -> None:
        token = self._announced[name]
        self._publish(PositionCommand(name, self.instance_name, token, token))

    def _publish_current_position(self, name: str) -> None:
        """``POSITION`` at our generator's position, not at the last token
        whose rows went out: that lags while ``_announce`` reads the new rows,
        and the generator may have persisted its position meanwhile (an idle
        writer moved up by another's, or a batch's own transaction), which a
        reader catches up to from the database; an answer from the lagging
        token would step back below it (issue 24). Our rows since the last
        announcement are then not sent as RDATA: a reader behind this position
        fills the gap from the database, and ``_announce``, finding
        ``_announced`` moved, stops."""
        position = self.store.stream(name).get_current_token_for_writer(self.instance_name)
        self._announced[name] = max(self._announced[name], position)
        self._publish_position(name)

    def _stream_advanced(self, name: str) -> None:
        if name in self._announced:
            self._schedule_announce(name)

    def _schedule_announce(self, name: str) -> None:
        if self._stopped:
            return
        if name in self._announcing:
            self._announce_again.add(name)
            return
        self._announcing.add(name)
        defer.ensureDeferred(self._announce(name)).addErrback(
            lambda f: log.failure("redis replication: announcing {stream} failed", f, stream=name)
        )

    async def _announce(self, name: str) -> None:
        """Publish our rows of ``name`` from the last announced token to our position.

        A page goes out pipelined (``_publish_page``: one write, one round
        trip), and the next page is read while it goes, as the TCP server's
        feed reads ahead; at most two pages are unacknowledged."""
        stream = self.streams.get(name)
        positions = self.store.stream(name)
        in_flight: defer.Deferred | None = None
        ahead: tuple[int, defer.Deferred] | None = None
        try:
            while True:
                self._announce_again.discard(name)
                target = positions.get_current_token_for_writer(self.instance_name)
                while self.ready and self._announced[name] < target:
                    start = self._announced[name]
                    if ahead is not None and ahead[0] == start:
                        read = ahead[1]
                    else:
                        _drop_read(ahead)
                        read = defer.ensureDeferred(
                            stream.get_updates(self.instance_name, start, target, self.page_size)
                        )
                    ahead = None
                    updates, upto, limited = await read
                    if not self.ready or self._announced[name] != start:
                        break  # a POSITION at our position went out meanwhile (connect, REPLICATE): it covers these
                    if limited and upto < target:
                        # The next page is read while this one goes out.
                        ahead = (
                            upto,
                            defer.ensureDeferred(stream.get_updates(self.instance_name, upto, target, self.page_size)),
                        )
                    sent = self._publish_page(name, updates, start, upto)
                    self._announced[name] = upto
                    # Back-pressure: at most two pages unacknowledged.
                    previous, in_flight = in_flight, sent
                    if previous is not None:
                        await previous
                if name in self._announce_again:
                    continue
                if in_flight is not None:
                    # The stream may move while we wait: look again after.
                    await in_flight
                    in_flight = None
                    continue
                return
        finally:
            _drop_read(ahead)
            self._announcing.discard(name)
            if not self._announcing:
                waiters, self._idle_waiters = self._idle_waiters, []
                for d in waiters:
                    d.callback(None)

    def _publish_page(self, name: str, updates: list, start: int, upto: int) -> defer.Deferred | None:
        """A page of our rows of ``name`` read from ``(start, upto]``: its
        RDATA lines (all but a token's last row with ``batch``), then
        ``POSITION`` if ``upto`` is past the last row, pipelined. Returns a
        Deferred firing once Redis acknowledged all of them (None if the
        connection is gone)."""
        conn = self._pub_conn
        if conn is None or not self.ready:
            return None
        with collector_paused():  # the page's lines, freed once written
            lines = _rdata_lines(name, self.instance_name, updates)
        last_row = updates[-1][0] if updates else start
        if upto > last_row:
            lines.append(serialize_command(PositionCommand(name, self.instance_name, last_row, upto)))
            metrics.REDIS_PUBLISHED.labels("POSITION").inc()
        if updates:
            metrics.REDIS_PUBLISHED.labels("RDATA").inc(len(updates))
        d = conn.publish_many(self.channel, lines)
        if d is not None:
            d.addErrback(lambda f: None)  # the connection went; reconnecting re-announces
        return d

    # ------------------------------------------------------------------ receiving

    def _on_message(self, channel: Any, message: Any) -> None:
        if self._stopped:
            return
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        message = str(message)
        words = message.split(" ", 3)
        if len(words) > 2 and words[2] == self.instance_name and words[0] in ("RDATA", "POSITION"):
            metrics.REDIS_RECEIVED.labels(words[0]).inc()
            return  # our own line: not even parsed
        if words[0] == "RDATA":
            # The worker's usual line: its fields without a command object
            # (as the TCP client parses it); a bad line takes the full parser.
            fields = parse_rdata_fields(message)
            if fields is not None:
                self._received_rdata.inc()
                self._on_rdata_fields(fields)
                return
        try:
            cmd = parse_command_from_line(message)
        except CommandParseError as exc:
            metrics.REDIS_RECEIVED.labels("invalid").inc()
            log.warn("redis replication: ignoring a line: {reason}", reason=exc.reason)
            return
        metrics.REDIS_RECEIVED.labels(cmd.NAME).inc()
        try:
            if isinstance(cmd, ReplicateCommand):
                for name in self.own_streams:
                    self._publish_current_position(name)
            elif isinstance(cmd, PositionCommand):
                if self._is_other_writer(cmd.stream_name, cmd.instance_name):
                    self._synced.add((cmd.stream_name, cmd.instance_name))
                    self.follower.on_position(cmd)
            elif isinstance(cmd, RdataCommand):
                self._on_rdata_fields((cmd.stream_name, cmd.instance_name, cmd.token, cmd.row))
        except CloseConnection as exc:
            self._resynchronise(exc)

    def _on_rdata_fields(self, fields: tuple) -> None:
        stream_name, instance_name = fields[0], fields[1]
        if not self._is_other_writer(stream_name, instance_name):
            return
        if (stream_name, instance_name) not in self._synced:
            metrics.REDIS_RDATA_BEFORE_POSITION.inc()
            self._ask_position(instance_name)
            return
        try:
            self.follower.on_rdata_fields(fields)
        except CloseConnection as exc:
            self._resynchronise(exc)

    def _resynchronise(self, exc: CloseConnection) -> None:
        """Too far behind to queue more: start over from POSITIONs, which
        fill what was dropped from the database."""
        log.warn("redis replication: {reason}; resynchronising", reason=str(exc))
        self._synced.clear()
        self._asked.clear()
        self.follower.drop_partial_batches()
        self._publish(ReplicateCommand())

    async def _catch_up_from_database(self) -> None:
        """Fill what other writers persisted while we were away up to their
        persisted positions: a writer that has exited since (an import) is
        not there to answer REPLICATE with a POSITION."""
        for name in STORE_STREAMS:
            if self._stopped:
                return
            stream_positions = self.store.stream(name)
            try:
                persisted = await stream_positions.read_persisted_positions()
            except Exception:
                if self._stopped:
                    return  # stopped meanwhile: the store may already be closed
                raise
            if self._stopped:
                return
            for writer, token in sorted(persisted.items()):
                if self._is_other_writer(name, writer):
                    self.follower.catch_up(name, writer, token)

    def _is_other_writer(self, stream_name: str, instance_name: str) -> bool:
        if instance_name == self.instance_name or stream_name not in self.store.stream_names:
            return False
        return instance_name in self.store.stream(stream_name).writers

    def _ask_position(self, instance_name: str) -> None:
        """RDATA from a writer we have no POSITION of (its answer to our
        REPLICATE was lost, or it has not heard it): ask it directly, once."""
        if instance_name not in self._asked:
            self._asked.add(instance_name)
            self._publish(ReplicateCommand(), f"{self.channel}/{instance_name}")
