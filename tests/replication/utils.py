"""Test helpers: transports as line lists, recording handlers, controllable streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport, StringTransportWithDisconnection

from roomstore.replication import (
    InMemoryStream,
    ReplicationClientHandler,
    ReplicationConfig,
    ReplicationServerFactory,
    ServerReplicationProtocol,
    Stream,
    StreamRegistry,
)

#: 2017-03-22T15:47:45.618Z, the time of the seed document's example exchange.
SEED_TIME = 1490197665.618


def written(transport: StringTransport) -> list[str]:
    """Every line written to ``transport`` so far."""
    return transport.value().decode("utf-8").splitlines()


def take(transport: StringTransport) -> list[str]:
    """The lines written since the last call, clearing them."""
    lines = written(transport)
    transport.clear()
    return lines


def feed(protocol: Any, *lines: str | bytes) -> None:
    """Deliver ``lines`` to ``protocol`` as if they came from the network."""
    for line in lines:
        data = line.encode("utf-8") if isinstance(line, str) else line
        protocol.dataReceived(data + b"\n")


def seed_registry(position: int = 1) -> StreamRegistry:
    """events, backfill and caches, each written by "master" up to ``position``."""
    registry = StreamRegistry()
    for name in ("events", "backfill", "caches"):
        stream = InMemoryStream(name)
        stream.advance("master", position)
        registry.register(stream)
    return registry


def make_server(
    registry: StreamRegistry | None = None,
    clock: Clock | None = None,
    server_name: str = "localhost:8823",
    **config: Any,
) -> ReplicationServerFactory:
    return ReplicationServerFactory(
        server_name,
        registry if registry is not None else seed_registry(),
        clock if clock is not None else Clock(),
        ReplicationConfig(**config),
    )


def connect(
    factory: ReplicationServerFactory, transport: StringTransport | None = None
) -> tuple[ServerReplicationProtocol, StringTransport]:
    """Build a server protocol, connect it to a fresh StringTransport, and
    discard its greeting (SERVER, PING)."""
    protocol = factory.buildProtocol(None)
    transport = transport if transport is not None else StringTransport()
    if isinstance(transport, StringTransportWithDisconnection):
        transport.protocol = protocol
    protocol.makeConnection(transport)
    transport.clear()
    return protocol, transport


def rdata_tokens(lines: Sequence[str]) -> list[str]:
    """The token field of every RDATA line ("batch" or a number)."""
    return [line.split(" ", 4)[3] for line in lines if line.startswith("RDATA ")]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class RecordingHandler(ReplicationClientHandler):
    """Records every call the client makes on its handler."""

    def __init__(self, streams: StreamRegistry | None = None) -> None:
        super().__init__(streams if streams is not None else StreamRegistry())
        self.rdata: list[tuple[str, str, int, list[Any]]] = []
        self.positions: list[tuple[str, str, int, int]] = []
        self.remote_servers: list[str] = []
        self.connected = 0

    def on_rdata(self, stream_name: str, instance_name: str, token: int, rows: list[Any]) -> None:
        self.rdata.append((stream_name, instance_name, token, list(rows)))

    def on_position(self, stream_name: str, instance_name: str, prev_token: int, new_token: int) -> None:
        self.positions.append((stream_name, instance_name, prev_token, new_token))

    def on_remote_server_up(self, server: str) -> None:
        self.remote_servers.append(server)

    def on_connected(self) -> None:
        self.connected += 1


class GatedStream(Stream):
    """Wraps a stream; every ``get_updates`` waits until the test releases it,
    as a slow database read would. Rows are read at release time."""

    def __init__(self, inner: Stream) -> None:
        self.inner = inner
        self.name = inner.name
        self.waiting: list[tuple[tuple[str, int, int, int], defer.Deferred[None]]] = []
        self.calls: list[tuple[str, int, int, int]] = []

    def writers(self) -> Sequence[str]:
        return self.inner.writers()

    def current_token(self, instance_name: str) -> int:
        return self.inner.current_token(instance_name)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int):
        args = (instance_name, from_token, upto_token, limit)
        self.calls.append(args)
        gate: defer.Deferred[None] = defer.Deferred()
        self.waiting.append((args, gate))
        await gate
        return await self.inner.get_updates(instance_name, from_token, upto_token, limit)

    def release(self) -> tuple[str, int, int, int]:
        """Let the oldest waiting read finish; returns its arguments."""
        args, gate = self.waiting.pop(0)
        gate.callback(None)
        return args


class CountingStream(Stream):
    """Wraps a stream and records each get_updates call and page size."""

    def __init__(self, inner: Stream) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[str, int, int, int]] = []
        self.page_sizes: list[int] = []

    def writers(self) -> Sequence[str]:
        return self.inner.writers()

    def current_token(self, instance_name: str) -> int:
        return self.inner.current_token(instance_name)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int):
        self.calls.append((instance_name, from_token, upto_token, limit))
        result = await self.inner.get_updates(instance_name, from_token, upto_token, limit)
        self.page_sizes.append(len(result[0]))
        return result
