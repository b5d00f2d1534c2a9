"""Replication as Twisted services: the writer's server, a worker's follower.

:class:`ReplicationServerService` is the main process: it opens a
``RoomStore`` as the writer of every stream, serves the store's streams over
TCP replication (bound to loopback unless told otherwise) and tells the
server about every committed batch. :class:`FollowerService` is a worker: it
opens a store as a reader of the writer's streams and follows the server,
applying what arrives (``StoreReplicationHandler``) and logging one line per
applied token.

Both are ordinary ``twisted.application.service.Service`` objects: the
``roomstore serve`` / ``roomstore follow`` commands and the ``twistd
roomstore`` plugin run them. ``startService`` starts an asynchronous start-up
(opening the database, migrating, listening or connecting); ``when_ready()``
fires when it is done or fails with what went wrong. ``stopService`` returns
a Deferred that fires once connections are closed and the store is closed.

Prometheus: the replication metrics (commands and bytes in and out,
connections, pending commands per paused connection, congestion drops,
authentication failures) and the stream position gauges live in the default
registry; ``metrics_port`` serves them in the text format at ``/metrics``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from roomstore.replication.client import ReplicationClientFactory
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.follower import StreamPositions
from roomstore.replication.positions_file import (
    PositionsFileWriter,
    load_positions,
    reactor_threads,
    save_positions,
)
from roomstore.replication.server_factory import ReplicationServerFactory
from roomstore.replication.store_handler import StoreReplicationHandler
from roomstore.replication.store_streams import STORE_STREAMS, store_stream_registry, wire_server
from roomstore.replication.tls import ClientTLS, TLSConfigError, check_bind_protected, server_tls
from roomstore.storage.collector import freeze_startup_objects
from roomstore.store import RoomStore, StoreConfig

__all__ = [
    "DEFAULT_BIND",
    "DEFAULT_REPLICATION_PORT",
    "FollowerService",
    "ReplicationServerService",
    "load_positions",
    "parse_host_port",
    "read_secret_file",
    "run_service",
    "save_positions",
    "start_redis",
]

log = Logger()

DEFAULT_REPLICATION_PORT = 9092
#: Loopback only: replication carries every event of every room, and without
#: a secret anyone who can connect can read it.
DEFAULT_BIND = "127.0.0.1"


def read_secret_file(path: str) -> str:
    """The shared secret in ``path``: its first line, surrounding whitespace
    stripped. Raises ``ValueError`` if it is empty; warns (log) if other users
    may read the file."""
    with open(path, encoding="utf-8") as handle:
        secret = handle.readline().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warn("secret file {path} is readable by other users (mode {mode:o})", path=path, mode=mode & 0o777)
    return secret


def parse_host_port(value: str, default_port: int = DEFAULT_REPLICATION_PORT) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, or a bare host (default port)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    if not host:
        raise ValueError(f"no host in {value!r}")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad port in {value!r}") from None


async def run_service(reactor: Any, service: _AsyncService, started: Callable[[], None] | None = None) -> None:
    """Start ``service``, call ``started()``, and run until the reactor stops
    (SIGINT/SIGTERM); the service is stopped before the reactor goes, so
    connections and the store are closed. If start-up fails, what it opened
    is closed and the error raised."""
    service.startService()
    try:
        await service.when_ready()
    except BaseException:
        await service.stopService()
        raise
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    # What start-up made lives as long as the process: out of the cyclic
    # collector's walks from now on (``storage.collector``).
    freeze_startup_objects()
    if started is not None:
        started()
    store = getattr(service, "store", None)
    lost = store.writer_lock_lost() if store is not None else None
    if lost is not None:
        # Fires only if another process took this writer's lock while a
        # database restart had freed it: stop (the line says why).
        raise await lost
    await defer.Deferred()  # fires never: the reactor stopping ends the process


def _listen_metrics(reactor: Any, port: int, interface: str) -> IListeningPort:
    from prometheus_client.twisted import MetricsResource
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    root = Resource()
    root.putChild(b"metrics", MetricsResource())
    return reactor.listenTCP(port, Site(root), interface=interface)


class _AsyncService(Service):
    """A Service whose start-up and shutdown are coroutines."""

    #: Stop the reactor if start-up fails (twistd: nothing else would).
    stop_reactor_on_failure = False

    def __init__(self, reactor: Any = None) -> None:
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.reactor = reactor
        self._started: defer.Deferred | None = None
        self._start_failure: Failure | None = None

    def startService(self) -> None:
        super().startService()
        self._started = defer.ensureDeferred(self._start())
        self._started.addErrback(self._start_failed)

    def _start_failed(self, failure: Failure) -> None:
        self._start_failure = failure
        # when_ready() hands the error on (the command line prints it in one
        # line): the traceback only at info level (-v).
        log.failure("{name} failed to start", failure=failure, name=self.name, level=LogLevel.info)
        if self.stop_reactor_on_failure and self.reactor.running:
            self.reactor.stop()

    def when_ready(self) -> defer.Deferred:
        """Fires with the service once started; fails if start-up failed."""
        if self._started is None:
            return defer.fail(RuntimeError("service not started"))
        d: defer.Deferred = defer.Deferred()

        def done(result: Any) -> Any:
            if self._start_failure is not None:
                d.errback(self._start_failure)
            else:
                d.callback(self)
            return result

        self._started.addBoth(done)
        return d

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return defer.ensureDeferred(self._stop_after_start())

    async def _stop_after_start(self) -> None:
        if self._started is not None:
            try:
                await self.when_ready()
            except Exception:
                pass  # already logged; close what was opened
        await self._stop()

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    async def _wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Poll ``predicate`` on the reactor for up to ``timeout`` seconds."""
        waited = 0.0
        while not predicate() and waited < timeout:
            await deferLater(self.reactor, 0.01, lambda: None)
            waited += 0.01
        return predicate()


def fit_read_ahead(config: ReplicationConfig, connections: int) -> ReplicationConfig:
    """``config`` with no more pages read ahead than a database pool of
    ``connections`` can read at once with one connection left for the
    writer: with one connection (SQLite) reads ahead would only queue behind
    each other and contend with the reactor thread (measured: slower)."""
    limit = max(1, connections - 1)
    return config if config.read_ahead <= limit else attrs.evolve(config, read_ahead=limit)


class ReplicationServerService(_AsyncService):
    """The writer: a store writing every stream, served over TCP replication.

    ``database``: a URL (or a ``Database``). ``port`` 0 picks a free port
    (read it from :attr:`port` after :meth:`when_ready`). ``secret``: require
    ``AUTH <secret>`` from every client. ``tls_cert``/``tls_key``: serve over
    TLS with this certificate and key (PEM files). A ``bind`` address that is
    not loopback needs a secret or TLS (``TLSConfigError`` otherwise). ``metrics_port``: serve Prometheus
    metrics on ``metrics_bind`` (default: ``bind``). Workers are sent new
    rows as soon as a stream's position moves (``wire_server``).

    After start: :attr:`store`, :attr:`factory`, :attr:`port` (the listening
    port), :attr:`metrics_port_listener`.
    """

    name = "roomstore-replication-server"

    def __init__(
        self,
        database: Any,
        *,
        port: int = DEFAULT_REPLICATION_PORT,
        bind: str = DEFAULT_BIND,
        server_name: str = "localhost",
        instance_name: str = "master",
        secret: str | None = None,
        metrics_port: int | None = None,
        metrics_bind: str | None = None,
        config: ReplicationConfig = ReplicationConfig(),
        store_config: StoreConfig | None = None,
        redis_url: str | None = None,
        redis_tls: ClientTLS | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        reactor: Any = None,
    ) -> None:
        super().__init__(reactor)
        if (tls_cert is None) != (tls_key is None):
            raise TLSConfigError("TLS needs both --tls-cert FILE and --tls-key FILE")
        check_bind_protected(bind, secret is not None, tls_cert is not None)
        # Read now: a bad file stops the start with one line, before the database.
        self.tls = server_tls(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self.database = database
        self.redis_url = redis_url
        self.redis_tls = redis_tls
        self.redis: Any = None
        self.listen_port = port
        self.bind = bind
        self.server_name = server_name
        self.store_config = store_config or StoreConfig(instance_name=instance_name)
        self.secret = secret
        self.metrics_listen_port = metrics_port
        self.metrics_bind = metrics_bind or bind
        self.config = config
        self.store: RoomStore | None = None
        self.factory: ReplicationServerFactory | None = None
        self.port: IListeningPort | None = None
        self.metrics_port_listener: IListeningPort | None = None
        self._unwire: Callable[[], None] | None = None

    async def _start(self) -> None:
        self.store = await RoomStore.open(self.database, self.store_config, reactor=self.reactor)
        self.factory = ReplicationServerFactory(
            self.server_name,
            store_stream_registry(self.store),
            self.reactor,
            fit_read_ahead(self.config, self.store.max_connections),
            secret=self.secret,
        )
        self._unwire = wire_server(self.store, self.factory.notify_new_rows)
        if self.redis_url is not None:
            self.redis = start_redis(self.store, self.redis_url, self.server_name, self.reactor, self.redis_tls)
        if self.tls is not None:
            self.port = self.reactor.listenSSL(self.listen_port, self.factory, self.tls, interface=self.bind)
        else:
            self.port = self.reactor.listenTCP(self.listen_port, self.factory, interface=self.bind)
        address = self.port.getHost()
        log.info(
            "replication server {name} listening on {host}:{port} ({auth}) over {tls}",
            name=self.server_name,
            host=address.host,
            port=address.port,
            auth="shared secret required" if self.secret else "no secret",
            tls="TLS" if self.tls is not None else "plaintext",
        )
        if self.metrics_listen_port is not None:
            self.metrics_port_listener = _listen_metrics(self.reactor, self.metrics_listen_port, self.metrics_bind)
            maddr = self.metrics_port_listener.getHost()
            log.info("metrics on http://{host}:{port}/metrics", host=maddr.host, port=maddr.port)

    async def _stop(self) -> None:
        if self._unwire is not None:
            self._unwire()
        if self.redis is not None:
            await self.redis.stop()
        if self.port is not None:
            await self.port.stopListening()
        if self.metrics_port_listener is not None:
            await self.metrics_port_listener.stopListening()
        if self.factory is not None:
            self.factory.close_all("server stopping")
            # close() aborts a connection after close_timeout; wait that long.
            factory = self.factory
            await self._wait(lambda: not factory.connections, self.config.close_timeout + 1)
        if self.store is not None:
            await self.store.close()
            self.store = None
        log.info("replication server stopped")


def start_redis(store: RoomStore, redis_url: str, channel: str, reactor: Any, tls: ClientTLS | None = None) -> Any:
    """A started ``RedisReplication`` of ``store`` (a writer announces, a reader applies)."""
    from roomstore.replication.redis import RedisReplication, parse_redis_url

    replication = RedisReplication(store, parse_redis_url(redis_url), channel, reactor=reactor, tls=tls)
    replication.start()
    return replication


class _FollowerHandler(StoreReplicationHandler):
    """Reports position moves too, so the service can save them."""

    def __init__(self, store: RoomStore, on_applied: Callable[..., Any], on_moved: Callable[[str, str, int], Any]):
        super().__init__(store, on_applied=on_applied)
        self._on_moved = on_moved

    def on_position(self, stream_name: str, instance_name: str, prev_token: int, new_token: int) -> None:
        super().on_position(stream_name, instance_name, prev_token, new_token)
        if stream_name in STORE_STREAMS:
            self._on_moved(stream_name, instance_name, new_token)


class FollowerService(_AsyncService):
    """A worker: a store reading the writer's streams, following the server.

    ``database``: the same database the writer uses. ``host``/``port``: the
    server's replication listener. ``writer``: the writer instance of every
    stream. ``expected_server_name``: refuse a server naming itself otherwise
    (None: any). ``secret``: sent as ``AUTH``. ``tls``: connect over TLS
    (a ``ClientTLS``: the CA that signed the server's certificate, whose
    name must be ``host``), to the server or, with ``redis_url``, to Redis.

    Resuming: with ``positions_file``, the position of every (stream, writer)
    is saved there after each applied token or position move (on a thread,
    at most one write at a time, the newest positions next: a burst of tokens
    costs two writes; ``positions_file.PositionsFileWriter``) and on stop,
    and read back at start, so a worker killed at any moment asks the server
    to replay from its last saved token: tokens may be applied again (those
    applied since the last write finished), none is skipped. Without the file (or on first
    start) the worker starts from its store's positions: a fresh process has
    no cached state older than them.

    ``run_in_thread(f, *args)`` runs those writes (default: the reactor's
    thread pool; a test passes one it drives).

    ``on_applied(stream, instance, token, rows)`` is called after each applied
    token, before its position is saved. After start: :attr:`store`,
    :attr:`factory`, :attr:`handler`, :attr:`resumed_from`.
    """

    name = "roomstore-follower"

    def __init__(
        self,
        database: Any,
        host: str | None,
        port: int | None,
        *,
        name: str = "worker1",
        writer: str = "master",
        expected_server_name: str | None = None,
        secret: str | None = None,
        positions_file: str | None = None,
        on_applied: Callable[[str, str, int, list], Any] | None = None,
        config: ReplicationConfig = ReplicationConfig(),
        redis_url: str | None = None,
        stream_writers: Mapping[str, Any] | None = None,
        metrics_port: int | None = None,
        tls: ClientTLS | None = None,
        reactor: Any = None,
        run_in_thread: Callable[..., defer.Deferred] | None = None,
    ) -> None:
        super().__init__(reactor)
        self.tls = tls
        self.run_in_thread = run_in_thread
        self.metrics_listen_port = metrics_port
        self.metrics_port_listener: IListeningPort | None = None
        if (host is None) == (redis_url is None):
            raise ValueError("follow a replication server (host, port) or Redis (redis_url), one of them")
        self.database = database
        self.redis_url = redis_url
        self.redis: Any = None
        self.stream_writers = (
            {n: list(stream_writers.get(n, [writer])) for n in STORE_STREAMS}
            if stream_writers
            else {n: [writer] for n in STORE_STREAMS}
        )
        self.host = host
        self.server_port = port
        self.instance_name = name
        self.writer = writer
        self.expected_server_name = expected_server_name
        self.secret = secret
        self.positions_file = positions_file
        self.on_applied = on_applied
        self.config = config
        self.store: RoomStore | None = None
        self.handler: StoreReplicationHandler | None = None
        self.factory: ReplicationClientFactory | None = None
        self.resumed_from: dict[tuple[str, str], int] = {}
        self._positions: dict[tuple[str, str], int] = {}
        self._positions_writer: PositionsFileWriter | None = None
        self._connector: Any = None

    async def _start(self) -> None:
        store_config = StoreConfig(instance_name=self.instance_name, stream_writers=self.stream_writers)
        self.store = await RoomStore.open(self.database, store_config, reactor=self.reactor)
        self.handler = _FollowerHandler(self.store, self._applied, self._moved)
        if self.positions_file:
            self._positions_writer = PositionsFileWriter(
                self.positions_file, self.run_in_thread or reactor_threads(self.reactor)
            )
        if self.metrics_listen_port is not None:
            self.metrics_port_listener = _listen_metrics(self.reactor, self.metrics_listen_port, DEFAULT_BIND)
        if self.redis_url is not None:
            self._start_redis()
            return
        self.factory = ReplicationClientFactory(
            self.handler,
            self.instance_name,
            self.expected_server_name,
            clock=self.reactor,
            config=self.config,
            secret=self.secret,
        )
        for (stream, instance), token in self._resume_positions().items():
            self.factory.positions.set(stream, instance, token)
        if self.tls is not None:
            from twisted.protocols.tls import TLSMemoryBIOFactory

            tls_factory = TLSMemoryBIOFactory(self.tls.options(self.host), True, self.factory)
            self._connector = self.reactor.connectTCP(self.host, self.server_port, tls_factory)
        else:
            self._connector = self.reactor.connectTCP(self.host, self.server_port, self.factory)

    def _resume_positions(self) -> dict[tuple[str, str], int]:
        saved = load_positions(self.positions_file) if self.positions_file else None
        source = "positions file" if saved is not None else "store"
        positions = saved if saved is not None else dict(self.handler.initial_positions().items())
        self.resumed_from = dict(positions)
        self._positions = dict(positions)
        log.info(
            "worker {name} resuming from {source}: {positions}; store events positions {store_positions}",
            name=self.instance_name,
            source=source,
            positions=" ".join(f"{s}/{i}={t}" for (s, i), t in sorted(positions.items())),
            store_positions=json.dumps(self.store.stream("events").get_positions(), sort_keys=True),
        )
        return positions

    def _start_redis(self) -> None:
        from roomstore.replication.redis import RedisReplication, parse_redis_url

        tracked = StreamPositions()
        for (stream, instance), token in self._resume_positions().items():
            tracked.set(stream, instance, token)
        self.redis = RedisReplication(
            self.store,
            parse_redis_url(self.redis_url),
            self.expected_server_name or "localhost",
            reactor=self.reactor,
            handler=self.handler,
            positions=tracked,
            page_size=self.config.page_size,
            tls=self.tls,
        )
        self.redis.start()

    def _applied(self, stream: str, instance: str, token: int, rows: list) -> None:
        log.info(
            "applied {stream} {instance} {token} rows={count} linear={linear}",
            stream=stream,
            instance=instance,
            token=token,
            count=len(rows),
            linear=self.store.stream(stream).get_current_token(),
        )
        if self.on_applied is not None:
            self.on_applied(stream, instance, token, rows)
        self._moved(stream, instance, token)

    def _moved(self, stream: str, instance: str, token: int) -> None:
        if self._positions.get((stream, instance)) == token:
            return
        log.info(
            "position {stream} {instance} {token} linear={linear}",
            stream=stream,
            instance=instance,
            token=token,
            linear=self.store.stream(stream).get_current_token(),
        )
        self._positions[(stream, instance)] = token
        if self._positions_writer is not None:
            self._positions_writer.update(self._positions)

    @property
    def positions(self) -> StreamPositions:
        """The follower's positions (the client factory's, or Redis's)."""
        if self.redis is not None:
            return self.redis.positions
        assert self.factory is not None
        return self.factory.positions

    async def _stop(self) -> None:
        if self.metrics_port_listener is not None:
            await self.metrics_port_listener.stopListening()
        if self.redis is not None:
            await self.redis.stop()
        if self.factory is not None:
            self.factory.stop()
        if self._connector is not None:
            connector = self._connector
            connector.disconnect()
            await self._wait(lambda: connector.state == "disconnected", self.config.close_timeout + 1)
        if self._positions_writer is not None:
            # Nothing applies any more: the last positions go to the file.
            await self._positions_writer.flush()
        if self.store is not None:
            await self.store.close()
            self.store = None
