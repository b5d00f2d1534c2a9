"""TCP replication from a writer store to a worker over loopback TCP.

usage: bench/with-postgres .venv/bin/python bench/replication.py [--events N] [--runs R] [--congestion-events N]
       [--sections parse catchup live breakdown transports congestion] [--page-sizes N...] [--read-ahead N...]
       [--parse-lines N] [--profile] [--transports-only] [--writer-in-flight K] [--writer-validation-processes N]
       [--writer-process]

0. Parsing: roomstore's and Synapse's parse_command_from_line (where
   matrix-synapse is importable) on the same events RDATA lines, interleaved
   runs, and a cProfile breakdown of each.

1. Throughput: the writer (ReplicationServerService, this process) holds N
   persisted events; a worker in a child process (a worker store, the real
   client factory and StoreReplicationHandler) connects with every position
   at 0, so the server replays the whole history: database pages read,
   RDATA lines written, sent over loopback, parsed, batched and applied to
   the worker's store. Reported: RDATA lines/s and tokens/s from the
   worker's connection to its events and caches positions reaching the
   writer's, median of R runs, per engine and page size.

3. Live traffic (printed after 1): a worker connected and caught up while
   the writer writes; RDATA lines/s at the worker from its first row to the
   writer's positions, parse and apply included. Writers: N persisted events
   as the writer commits them (bounded by event validation), the same with
   the server told only once all are written (burst), and a bulk writer of
   N cache invalidations committing 1,000 stream IDs per transaction as fast
   as it can, the server told per commit (live rows bounded by allocation
   and commit). The event writer keeps ``--writer-in-flight`` calls in
   flight (default 1: each awaited; more: group commit, as
   ``bench/event_store.py --in-flight``) with the store's
   ``validation_processes`` at ``--writer-validation-processes``; with
   ``--writer-process`` its writes run in a child process
   (``StoreConfig.writer_process``; the server, in this process, learns
   each batch from the child's replies), and the caches bulk writer, which
   writes through this process's database, is left out.

5. Breakdown (printed after 3): each stage of a catch-up alone, in one
   process, on the same persisted events: the database pages as the server
   reads them (``get_encoded_updates``: the rows' JSON text) and as a
   worker reads them (``get_updates``: rows, over Redis or for a gap),
   encoding and writing them (into a transport that keeps nothing), the
   server's whole catch-up loop, and the worker reading, parsing and
   applying the lines; lines per wall and per CPU second.

4. Redis vs direct TCP (needs redis-server; a private one is started): the
   same N persisted events, sent to a worker process (the same worker store
   and ``StoreReplicationHandler``) once by the TCP server replaying from
   token 0 and once by the writer's ``RedisReplication`` publishing them on
   Redis from token 0 (``replay_from``), runs alternating. Reported per
   transport: RDATA lines the worker received, rows it applied (a Redis
   worker reads what it did not hear from the shared database: up to the
   writer's persisted positions when it connects, and any gap a POSITION
   shows), the wall time from its first applied token to its events and
   caches positions reaching the writer's (the same clock for both) and its
   ratio to TCP's, rows/s; median of R runs. Both workers read the database
   in pages of the default size, the TCP server's (500 before issue 27's
   item 5).

Processes: the worker processes and this one (the server) freeze what
start-up made (``gc.freeze``) as ``roomstore follow`` and ``serve`` do;
``BENCH_FREEZE=0`` leaves it (the code before issue 27's second catch-up
step did not freeze).

2. Congestion: while the writer persists N events, a client that never reads
   its socket (small receive buffer; it keeps sending PINGs so only the
   congestion handling can act) stays connected next to a healthy worker.
   For each ``max_pending_commands``: peak commands in the connection's
   pending queue, peak bytes in its transport buffer, the server's peak RSS
   growth against a run with no slow client, whether and when the slow
   client was dropped, whether the healthy worker kept up, and how long the
   slow client took to catch up once it started reading again.
"""

from __future__ import annotations

import argparse
import collections
import json
import operator
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attrs
from twisted.internet import defer, task
from twisted.internet.task import deferLater

from bench._common import bench_databases, print_table
from roomstore.storage.collector import freeze_startup_objects

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_second = operator.itemgetter(1)
STREAMS = ("events", "backfill", "caches")


# ---------------------------------------------------------------- helpers


def rss_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def count_wakeups(reactor) -> list[int]:
    """Count the reactor's iterations (each a poll that returned, a wake-up
    unless work was already waiting) in the returned one-item list."""
    count = [0]
    iterate = reactor.doIteration

    def counted(timeout):
        count[0] += 1
        return iterate(timeout)

    reactor.doIteration = counted
    return count


_SERVER_WAKEUPS: list[list[int]] = []


def server_wakeup_counter(reactor) -> list[int]:
    """This (the server's) process's wake-up counter, made once."""
    if not _SERVER_WAKEUPS:
        _SERVER_WAKEUPS.append(count_wakeups(reactor))
    return _SERVER_WAKEUPS[0]


async def sleep(reactor, seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def until(reactor, predicate, timeout: float, what: str) -> float:
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(what)
        await sleep(reactor, 0.002)
    return time.perf_counter()


async def exited(proc: subprocess.Popen) -> int:
    """Wait for a child process to exit in a thread blocked in waitpid: the
    server's reactor stays asleep meanwhile (polling the child every 2 ms
    woke it ~4x as often as the rows did, and counted as server CPU)."""
    from twisted.internet import threads

    return await threads.deferToThread(proc.wait, 600)


def history(rooms: int, events: int):
    """Batches of up to 50 events: rooms with a dozen members joining, then
    messages, some state changes (so events carry state rows and the caches
    stream has rows)."""
    sys.path.insert(0, REPO)
    from tests.store.builder import RoomBuilder

    builders = [RoomBuilder(f"!bench{r}:example.org") for r in range(rooms)]
    per_room = events // rooms
    for r, room in enumerate(builders):
        users = [f"@u{i}:example.org" for i in range(12)]
        built = [room.create(), room.join(room.creator)] + [room.join(u) for u in users]
        while len(built) < per_room:
            n = len(built)
            if n % 40 == 0:
                built.append(room.state("m.room.topic", "", {"topic": f"topic {n}"}))
            else:
                built.append(room.message(users[n % len(users)], f"message {n} in room {r}"))
        for start in range(0, len(built), 50):
            yield [room.to_persist(e) for e in built[start : start + 50]]


async def start_server(reactor, url: str, **kw):
    from roomstore.replication.process_services import ReplicationServerService

    service = ReplicationServerService(url, port=0, server_name="bench", reactor=reactor, **kw)
    service.startService()
    await service.when_ready()
    if os.environ.get("BENCH_FREEZE", "1") == "1":
        freeze_startup_objects()  # as `roomstore serve` does once started
    return service


# ---------------------------------------------------------------- 1. throughput


async def worker_main(reactor, url: str, port: int, targets: dict | None, page_size: int) -> None:
    """Child process: follow from 0 until the targets; print one JSON line.

    ``targets`` None (live runs): print ``{"ready": true}`` once connected,
    then read the targets from a line on stdin, and time from the first row
    applied rather than from the connection."""
    from prometheus_client import REGISTRY

    from roomstore.replication import ReplicationClientFactory, ReplicationConfig
    from roomstore.replication.store_handler import StoreReplicationHandler
    from roomstore.store import RoomStore, StoreConfig

    store = await RoomStore.open(url, StoreConfig("bench-worker", {s: ["master"] for s in STREAMS}), reactor=reactor)
    if os.environ.get("BENCH_FREEZE", "1") == "1":
        freeze_startup_objects()  # as `roomstore follow` does once started
    try:
        counts = {"tokens": 0, "rows": 0}

        first_row: list[float] = []
        first_cpu: list[float] = []
        # Done when every stream's applied token (RDATA applied, or POSITION)
        # reaches its target: noted as it happens, not polled (a poll every
        # 2 ms cost more worker CPU than the rows of a live run as written).
        goal: dict[str, int] = {}
        reached: dict[str, int] = {}
        finished: defer.Deferred = defer.Deferred()

        def check() -> None:
            if goal and not finished.called and all(reached.get(s, 0) >= t for s, t in goal.items()):
                finished.callback((time.perf_counter(), time.process_time()))

        def note(stream: str, token: int) -> None:
            if token > reached.get(stream, 0):
                reached[stream] = token
                if token >= goal.get(stream, token + 1):
                    check()

        def applied(stream: str, tokens: int, rows: int, last: int) -> None:
            if not first_row:
                first_row.append(time.perf_counter())
                first_cpu.append(time.process_time())
                wakeups_at_start.append((wakeups[0], reads[0]))
            counts["tokens"] += tokens
            counts["rows"] += rows
            note(stream, last)

        class Handler(StoreReplicationHandler):
            # Counted per call the worker makes (a token, or a read's tokens
            # at once), not per token: the count is the bench's own work.
            def on_rdata(self, stream_name, instance_name, token, rows):
                super().on_rdata(stream_name, instance_name, token, rows)
                applied(stream_name, 1, len(rows), token)

            def on_rdata_batch(self, stream_name, instance_name, updates):
                super().on_rdata_batch(stream_name, instance_name, updates)
                applied(stream_name, len(updates), sum(map(len, map(_second, updates))), updates[-1][0])

            def on_rdata_rows(self, stream_name, instance_name, tokens, rows):
                super().on_rdata_rows(stream_name, instance_name, tokens, rows)
                applied(stream_name, len(tokens) - tokens.count(None), len(rows), tokens[-1])

            def on_position(self, stream_name, instance_name, prev_token, new_token):
                super().on_position(stream_name, instance_name, prev_token, new_token)
                note(stream_name, new_token)

        handler = Handler(store)
        connected = []
        connected_cpu = []
        handler.on_connected = lambda: (
            connected.append(time.perf_counter()),
            connected_cpu.append(time.process_time()),
        )
        factory = ReplicationClientFactory(
            handler, "bench-worker", "bench", clock=reactor, config=ReplicationConfig(page_size=page_size)
        )
        for stream in STREAMS:
            factory.positions.set(stream, "master", 0)
        # Reads (dataReceived calls) and wake-ups, from the connection on.
        reads = [0]
        build = factory.buildProtocol

        def counting_build(addr):
            protocol = build(addr)
            receive = protocol.dataReceived

            def data_received(data: bytes) -> None:
                reads[0] += 1
                receive(data)

            protocol.dataReceived = data_received
            return protocol

        factory.buildProtocol = counting_build
        wakeups = count_wakeups(reactor)
        wakeups_at_start = []
        profile_path = os.environ.get("BENCH_PROFILE")
        profiler = None
        if profile_path:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        if targets is not None:
            goal.update(targets)
        reactor.connectTCP("127.0.0.1", port, factory)
        if targets is None:
            from twisted.internet import threads

            await until(reactor, lambda: factory.connection is not None, 60, "connection")
            await sleep(reactor, 0.2)  # the REPLICATE answered
            print(json.dumps({"ready": True}), flush=True)
            targets = json.loads(await threads.deferToThread(sys.stdin.readline))
            goal.update(targets)
            check()  # reached already (rows as written): done now
        # The follower's own tokens: the store's generators start at the
        # database's positions, already at the targets.
        done, cpu_done = await finished.addTimeout(600, reactor)
        wakeups_done = list(wakeups)
        # It fired inside the read that applied the last row: let that read
        # end, which adds its lines to the RDATA counter.
        await sleep(reactor, 0)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
        rdata = (
            REGISTRY.get_sample_value(
                "roomstore_replication_commands_received_total", {"side": "client", "command": "RDATA"}
            )
            or 0.0
        )
        received = REGISTRY.get_sample_value("roomstore_replication_received_bytes_total", {"side": "client"}) or 0.0
        factory.stop()
        live = first_row and os.environ.get("BENCH_LIVE")
        start, cpu_start = (first_row[0], first_cpu[0]) if live else (connected[0], connected_cpu[0])
        # Live: from the first row's read on (that read included).
        wakeups_from, reads_from = (wakeups_at_start[0][0] - 1, wakeups_at_start[0][1] - 1) if live else (0, 0)
        print(
            json.dumps(
                {
                    "seconds": done - start,
                    "cpu": cpu_done - cpu_start,
                    "rdata": rdata,
                    **counts,
                    "reads": reads[0] - reads_from,
                    "bytes": received,
                    "wakeups": wakeups_done[0] - wakeups_from,
                }
            ),
            flush=True,
        )
    except BaseException:
        import traceback

        traceback.print_exc()
        raise
    finally:
        # The database's thread pool would keep the process alive otherwise.
        await store.close()


async def throughput(
    reactor,
    engine: str,
    new_url,
    events: int,
    runs: int,
    page_sizes,
    profile: bool = False,
    profiles: list | None = None,
    read_aheads=(2,),
) -> list[list]:
    """Catch-up from token 0, per page size and ``read_ahead`` (the server's
    config, changed between runs of one server): the settings of one page
    size take turns run by run, so the load of the machine falls on each alike."""
    import attrs

    url = new_url()
    rows = []
    wakeups = server_wakeup_counter(reactor)
    for page_size in page_sizes:
        from roomstore.replication import ReplicationConfig

        server = await start_server(reactor, url, config=ReplicationConfig(page_size=page_size))
        if server.store.events_stream.get_current_token() == 0:
            started = time.perf_counter()
            for batch in history(20, events):
                await server.store.persist_events(batch)
            print(
                f"  ({engine}: persisted {server.store.events_stream.get_current_token()} events "
                f"in {time.perf_counter() - started:.1f}s)",
                file=sys.stderr,
            )
        targets = {s: server.store.generators[s].get_current_token() for s in ("events", "caches")}
        samples: dict[int, list] = {ahead: [] for ahead in read_aheads}
        for run in range(runs + (1 if profile else 0)):
            for read_ahead in read_aheads:
                server.factory.config = attrs.evolve(server.factory.config, read_ahead=read_ahead)
                # The extra (last) run is profiled on both sides and not counted.
                profiling = profile and run == runs
                env = dict(os.environ, PYTHONPATH=REPO)
                server_profiler = None
                if profiling:
                    import cProfile
                    import tempfile

                    worker_stats = tempfile.mktemp(prefix="bench-worker-", suffix=".prof")
                    env["BENCH_PROFILE"] = worker_stats
                    server_profiler = cProfile.Profile(time.process_time)
                    server_profiler.enable()
                argv = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--worker",
                    url,
                    str(server.port.getHost().port),
                    json.dumps(targets),
                    str(page_size),
                ]
                server_cpu = time.process_time()
                server_wakeups = wakeups[0]
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
                await exited(proc)
                server_cpu = time.process_time() - server_cpu
                server_wakeups = wakeups[0] - server_wakeups
                if server_profiler is not None:
                    server_profiler.disable()
                    profiles.append(
                        (
                            f"{engine}, page size {page_size}, read-ahead {read_ahead}, catch-up",
                            server_profiler,
                            worker_stats,
                        )
                    )
                    proc.stdout.read()
                    continue
                out = proc.stdout.read().decode().strip().splitlines()
                if proc.returncode != 0 or not out:
                    raise RuntimeError(f"worker failed ({proc.returncode})")
                samples[read_ahead].append(
                    {**json.loads(out[-1]), "server_cpu": server_cpu, "server_wakeups": server_wakeups}
                )
        await server.stopService()
        for read_ahead, got in samples.items():
            rates = sorted(s["rdata"] / s["seconds"] for s in got)
            sample = got[0]
            rows.append(
                [
                    engine,
                    page_size,
                    read_ahead,
                    targets["events"],
                    int(sample["rdata"]),
                    sample["tokens"],
                    statistics.median(s["seconds"] for s in got),
                    statistics.median(rates),
                    rates[0],
                    rates[-1],
                    statistics.median(s["tokens"] / s["seconds"] for s in got),
                    statistics.median(s["rdata"] / s["cpu"] for s in got),
                    statistics.median(s["rdata"] / s["server_cpu"] for s in got),
                    statistics.median(s["reads"] for s in got),
                    statistics.median(s["bytes"] / s["reads"] / 1024 for s in got),
                    statistics.median(s["wakeups"] for s in got),
                    statistics.median(s["server_wakeups"] for s in got),
                ]
            )
    return rows


# ---------------------------------------------------------------- 0. parsing


def rdata_lines_of(store_rows: list, count: int) -> list[str]:
    """``count`` events RDATA lines as the server writes them: the stream's
    real rows (``(token, row)`` from EventsStream.get_updates), repeated with
    tokens moved past the previous copy's until there are ``count`` lines."""
    from roomstore.replication.commands import RdataCommand, serialize_command

    last = store_rows[-1][0]
    lines: list[str] = []
    copy = 0
    while len(lines) < count:
        offset = copy * last
        for index, (token, row) in enumerate(store_rows):
            end = index + 1 == len(store_rows) or store_rows[index + 1][0] != token
            lines.append(serialize_command(RdataCommand("events", "master", token + offset if end else None, row)))
        copy += 1
    return lines[:count]


async def parse_rows(reactor, new_url, events: int) -> list:
    from roomstore.replication.store_streams import EventsStream
    from roomstore.store import RoomStore

    store = await RoomStore.open(new_url(), reactor=reactor)
    try:
        for batch in history(20, events):
            await store.persist_events(batch)
        stream = EventsStream(store)
        current = stream.current_token("master")
        return (await stream.get_updates("master", 0, current, 10**9)).updates
    finally:
        await store.close()


def parse_section(rows: list, count: int, runs: int) -> float | None:
    """Print section 0; return Synapse's median lines/s (None without Synapse)."""
    import gc

    from roomstore.replication.commands import parse_command_from_line as ours

    lines = rdata_lines_of(rows, count)
    parsers = [("roomstore", ours)]
    try:
        from tests.synapse_oracle import prepare_synapse

        prepare_synapse()
        from synapse.replication.tcp.commands import parse_command_from_line as synapse

        parsers.append(("synapse 1.163", synapse))
    except ImportError:
        print("  (matrix-synapse is not importable: no Synapse figure; bin/setup installs it)")
    # Each run goes through the lines in chunks, each chunk through every
    # parser in turn (the order alternating), so the machine's load falls on
    # both alike; CPU time of this thread (time.thread_time) is not inflated
    # by other processes taking the core, wall time is.
    chunk = 10_000
    rates: dict[str, list[float]] = {name: [] for name, _ in parsers}
    cpu_rates: dict[str, list[float]] = {name: [] for name, _ in parsers}
    for _ in range(runs):
        wall = dict.fromkeys(rates, 0.0)
        cpu = dict.fromkeys(rates, 0.0)
        for index, start in enumerate(range(0, len(lines), chunk)):
            part = lines[start : start + chunk]
            for name, parse in parsers[:: 1 if index % 2 == 0 else -1]:
                gc.collect()
                started, started_cpu = time.perf_counter(), time.thread_time()
                for line in part:
                    parse(line)
                cpu[name] += time.thread_time() - started_cpu
                wall[name] += time.perf_counter() - started
        for name in rates:
            rates[name].append(len(lines) / wall[name])
            cpu_rates[name].append(len(lines) / cpu[name])
    table = []
    for name, samples in rates.items():
        table.append(
            [
                name,
                len(lines),
                statistics.median(samples),
                min(samples),
                max(samples),
                statistics.median(cpu_rates[name]),
            ]
        )
    headers = ["parser", "lines", "median lines/s", "min", "max", "median lines/CPU s"]
    if len(parsers) == 2:
        for label, source in (("wall", rates), ("CPU", cpu_rates)):
            ratios = [a / b for a, b in zip(source["roomstore"], source["synapse 1.163"], strict=True)]
            table[0].append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})")
            table[1].append("1.00x")
            headers.append(f"roomstore / synapse, {label}, same runs")
    print_table(headers, table)
    import cProfile

    for name, parse in parsers:
        profiler = cProfile.Profile()
        profiler.enable()
        for line in lines:
            parse(line)
        profiler.disable()
        print_profile(f"{name} parse_command_from_line, {len(lines)} lines", profiler, top=8)
    print(
        "  (cProfile does not time the C JSON scanner roomstore calls directly: it is in _rdata's own time; "
        "Synapse's goes through json.decoder's decode/raw_decode)"
    )
    return statistics.median(rates["synapse 1.163"]) if "synapse 1.163" in rates else None


# ---------------------------------------------------------------- 5. breakdown


class _DiscardingTransport:
    """A transport that counts what it is given and keeps nothing."""

    def __init__(self) -> None:
        from twisted.internet.address import IPv4Address

        self.written = 0
        self.disconnecting = False
        self._peer = IPv4Address("TCP", "127.0.0.1", 0)

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def writeSequence(self, seq) -> None:
        for data in seq:
            self.write(data)

    def getPeer(self):
        return self._peer

    def getHost(self):
        return self._peer

    def registerProducer(self, producer, streaming) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass

    def loseConnection(self) -> None:
        self.disconnecting = True

    def abortConnection(self) -> None:
        self.disconnecting = True


async def breakdown(reactor, engine: str, new_url, events: int, runs: int, page_size: int) -> list[list]:
    """Each stage of the catch-up path alone, on the same persisted events,
    in one process: where a line's time goes. Stages run in turns, run by
    run; CPU is this process's (its database threads included, PostgreSQL's
    own processes not)."""
    import gc

    from roomstore.replication import ReplicationClientFactory, ReplicationConfig, ReplicationServerFactory
    from roomstore.replication.store_handler import StoreReplicationHandler
    from roomstore.replication.store_streams import EventsStream, store_stream_registry
    from roomstore.store import RoomStore, StoreConfig

    url = new_url()
    store = await RoomStore.open(url, reactor=reactor)
    worker = await RoomStore.open(url, StoreConfig("bench-worker", {s: ["master"] for s in STREAMS}), reactor=reactor)
    try:
        for batch in history(20, events):
            await store.persist_events(batch)
        stream = EventsStream(store)
        current = stream.current_token("master")
        config = ReplicationConfig(page_size=page_size)
        server = ReplicationServerFactory("bench", store_stream_registry(store), reactor, config)
        timings: dict[str, list[tuple[float, float]]] = {}
        lines_of: dict[str, int] = {}

        def timed(name: str, lines: int, started: tuple[float, float]) -> None:
            wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
            timings.setdefault(name, []).append((lines / wall, lines / cpu))
            lines_of[name] = lines

        def now() -> tuple[float, float]:
            gc.collect()
            return time.perf_counter(), time.process_time()

        for _ in range(runs):
            # 1. The database pages, as the feed asks for them (one at a time):
            # the rows' JSON text, what the server sends.
            started = now()
            pages, start = [], 0
            while start < current:
                updates, upto, limited = await stream.get_encoded_updates("master", start, current, page_size)
                pages.append((start, updates, upto, limited))
                start = upto
            rows = sum(len(page[1]) for page in pages)
            timed(f"server: database pages of {page_size} (get_encoded_updates)", rows, started)
            # 1b. The same pages as rows (what a worker reads from the
            # database: over Redis, or filling a gap).
            started = now()
            row_pages, start = [], 0
            while start < current:
                updates, upto, limited = await stream.get_updates("master", start, current, page_size)
                row_pages.append(updates)
                start = upto
            timed(f"worker: database pages of {page_size} as rows (get_updates)", rows, started)
            # 2. Encoding and writing those pages (the feed's loop body).
            protocol = server.buildProtocol(None)
            sink = _DiscardingTransport()
            protocol.makeConnection(sink)
            feed = protocol.session.feed
            started = now()
            for start, updates, upto, limited in pages:
                protocol.send_rows(
                    "events", "master", feed._page_commands(stream, "master", start, updates, upto, limited)
                )
            timed("server: RDATA lines encoded and written", rows, started)
            protocol.connectionLost(None)
            # 3. The whole server side: REPLICATE events 0 into a discarding
            # transport (pages read ahead while others are written).
            protocol = server.buildProtocol(None)
            sink = _DiscardingTransport()
            protocol.makeConnection(sink)
            started = now()
            protocol.dataReceived(b"NAME bench\nREPLICATE events 0\n")
            await until(reactor, lambda: protocol.session.feed.is_idle(), 600, "server catch-up")
            timed(f"server: catch-up, read-ahead {config.read_ahead} (1 and 2 overlapped)", rows, started)
            protocol.connectionLost(None)
            # 4. The worker: bytes in, parsed and applied to a worker store.
            data = b"".join(
                (line + "\n").encode() for line in rdata_lines_of([(t, r) for u in row_pages for t, r in u], rows)
            )
            handler = StoreReplicationHandler(worker)
            client = ReplicationClientFactory(handler, "bench-worker", "bench", clock=reactor, config=config)
            client.positions.set("events", "master", 0)
            client_protocol = client.buildProtocol(None)
            client_protocol.makeConnection(_DiscardingTransport())
            client_protocol.dataReceived(b"SERVER bench\n")
            started = now()
            for offset in range(0, len(data), 1 << 16):
                client_protocol.dataReceived(data[offset : offset + (1 << 16)])
            timed("worker: lines read, parsed and applied", rows, started)
            if client.positions.get("events", "master") != current:
                raise RuntimeError("the worker did not apply every row")
            client_protocol.connectionLost(None)
            client.stop()
    finally:
        await worker.close()
        await store.close()
    return [
        [engine, name, lines_of[name], statistics.median(w for w, _ in got), statistics.median(c for _, c in got)]
        for name, got in timings.items()
    ]


# ---------------------------------------------------------------- 3. live traffic


async def write_invalidations(store, rows: int, batch: int = 1000) -> None:
    """The bulk writer of live runs: ``rows`` cache invalidations (one key
    each, one row per stream ID, as ``invalidate_cache`` writes them), ``batch``
    stream IDs reserved and committed per transaction, as fast as the writer
    can allocate and commit them; the server is told as each commit's IDs
    complete."""
    from roomstore.events.write.persist import write_cache_invalidations

    def write(txn, ids: list[int]) -> None:
        now_ms = int(time.time() * 1000)
        for stream_id in ids:
            write_cache_invalidations(txn, stream_id, store.instance_name, [("bench_cache", [f"k{stream_id}"])], now_ms)

    for start in range(0, rows, batch):
        async with store.caches_stream.get_next_mult(min(batch, rows - start)) as ids:
            await store.db.run_interaction("bench_invalidations", write, ids)


#: The live event writer: calls in flight, the store's validation processes (None: its default).
LIVE_WRITER = {"in_flight": 1, "validation_processes": None, "writer_process": False}


async def persist_in_flight(store, batches, in_flight: int) -> None:
    """``batches`` persisted in order, ``in_flight`` calls at a time."""
    pending: list = []
    for batch in batches:
        pending.append(defer.ensureDeferred(store.persist_events(batch)))
        if len(pending) >= in_flight:
            await pending.pop(0)
    for waiting in pending:
        await waiting


async def live_run(reactor, url: str, events: int, page_size: int, burst: bool, bulk: bool = False) -> dict:
    """A worker process connected and caught up; then the writer (this
    process) persists ``events`` events in batches of 50. ``burst``: the
    server is told of them only once all are written, so the rows reach the
    connected worker as fast as the live path carries them rather than as fast
    as the writer writes."""
    from roomstore.replication import ReplicationConfig, ReplicationServerFactory
    from roomstore.replication.store_streams import store_stream_registry, wire_server
    from roomstore.store import RoomStore, StoreConfig

    processes = LIVE_WRITER["validation_processes"]
    config = StoreConfig() if processes is None else StoreConfig(validation_processes=processes)
    config = attrs.evolve(config, writer_process=LIVE_WRITER["writer_process"])
    store = await RoomStore.open(url, config, reactor=reactor)
    factory = ReplicationServerFactory(
        "bench", store_stream_registry(store), reactor, ReplicationConfig(page_size=page_size)
    )
    held: set[str] = set()
    gate = [not burst]

    def notify(name: str) -> None:
        if gate[0]:
            factory.notify_new_rows(name)
        else:
            held.add(name)

    stop_wiring = wire_server(store, notify)
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", url, str(port.getHost().port), "-", str(page_size)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=REPO, BENCH_LIVE="1")
    )
    from twisted.internet import threads

    ready = await threads.deferToThread(proc.stdout.readline)
    if b"ready" not in ready:
        raise RuntimeError(f"worker did not start: {ready!r}")
    started = time.perf_counter()
    if bulk:
        await write_invalidations(store, events)
    else:
        await persist_in_flight(store, history(20, events), LIVE_WRITER["in_flight"])
    written = time.perf_counter() - started
    targets = {s: store.generators[s].get_current_token() for s in ("events", "caches")}
    proc.stdin.write((json.dumps(targets) + "\n").encode())
    proc.stdin.flush()
    if burst:
        gate[0] = True
        for name in sorted(held):
            factory.notify_new_rows(name)
    await exited(proc)
    out = proc.stdout.read().decode().strip().splitlines()
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"worker failed ({proc.returncode})")
    stop_wiring()
    factory.close_all()
    await port.stopListening()
    await store.close()
    written_rows = events if bulk else targets["events"]
    return {**json.loads(out[-1]), "write_s": written, "events": written_rows}


#: The live modes: (label, burst, bulk).
LIVE_MODES = (
    ("events, as written", False, False),
    ("events, burst (told after the writes)", True, False),
    ("caches bulk writer, as written", False, True),
)


async def live(reactor, engine: str, new_url, events: int, runs: int, page_size: int) -> list[list]:
    modes = [mode for mode in LIVE_MODES if not (mode[2] and LIVE_WRITER["writer_process"])]
    samples: dict[str, list] = {label: [] for label, _, _ in modes}
    for _ in range(runs):  # the modes take turns, run by run
        for label, burst, bulk in modes:
            samples[label].append(await live_run(reactor, new_url(), events, page_size, burst, bulk))
    rows = []
    for label, got in samples.items():
        rates = sorted(s["rdata"] / s["seconds"] for s in got)
        rows.append(
            [
                engine,
                label,
                page_size,
                got[0]["events"],
                int(got[0]["rdata"]),
                statistics.median(s["events"] / s["write_s"] for s in got),
                statistics.median(rates),
                rates[0],
                rates[-1],
                statistics.median(s["rdata"] / s["cpu"] for s in got),
                statistics.median(s["reads"] for s in got),
                statistics.median(s["rdata"] / s["reads"] for s in got),
                statistics.median(s["wakeups"] for s in got),
            ]
        )
    return rows


# ---------------------------------------------------------------- 3. Redis vs TCP


async def transport_worker_main(reactor, url: str, transport: str, address: str, targets: dict) -> None:
    """Child process: follow over ``transport`` from 0 until the targets; print one JSON line."""
    from prometheus_client import REGISTRY

    from roomstore.replication import ReplicationClientFactory, ReplicationConfig
    from roomstore.replication.follower import StreamPositions
    from roomstore.replication.store_handler import StoreReplicationHandler
    from roomstore.store import RoomStore, StoreConfig

    store = await RoomStore.open(url, StoreConfig("bench-worker", {s: ["master"] for s in STREAMS}), reactor=reactor)
    if os.environ.get("BENCH_FREEZE", "1") == "1":
        freeze_startup_objects()  # as `roomstore follow` does once started
    try:
        first: list[float] = []
        first_cpu: list[float] = []
        counted = [0]

        def applied(stream, instance, token, rows):
            if not first:
                first.append(time.perf_counter())
                first_cpu.append(time.process_time())
            counted[0] += len(rows)

        handler = StoreReplicationHandler(store, on_applied=applied)
        positions = StreamPositions()
        for stream in STREAMS:
            positions.set(stream, "master", 0)
        # Pages of the default size (the TCP server's here), so that each
        # transport reads the database in pages of the same size.
        page_size = ReplicationConfig().page_size
        if transport == "tcp":
            factory = ReplicationClientFactory(
                handler, "bench-worker", "bench", clock=reactor, config=ReplicationConfig(page_size=page_size)
            )
            factory.positions = positions
            reactor.connectTCP("127.0.0.1", int(address), factory)
            stop = factory.stop
            metric = ("roomstore_replication_commands_received_total", {"side": "client", "command": "RDATA"})
        else:
            from roomstore.replication.redis import RedisReplication, parse_redis_url

            redis = RedisReplication(
                store,
                parse_redis_url(address),
                "bench",
                reactor=reactor,
                handler=handler,
                positions=positions,
                page_size=page_size,
            )
            redis.start()
            await redis.when_ready()
            print("READY", flush=True)
            stop = redis.stop
            metric = ("roomstore_replication_redis_received_total", {"command": "RDATA"})
        done = await until(
            reactor, lambda: all((positions.get(s, "master") or 0) >= t for s, t in targets.items()), 600, "catch-up"
        )
        rdata = REGISTRY.get_sample_value(*metric) or 0.0
        result = stop()
        if isinstance(result, defer.Deferred) or hasattr(result, "__await__"):
            await result
        cpu = time.process_time() - first_cpu[0]
        print(json.dumps({"seconds": done - first[0], "cpu": cpu, "rdata": rdata, "rows": counted[0]}), flush=True)
    finally:
        await store.close()


async def transports(reactor, new_url, events: int, runs: int) -> list[list]:
    from roomstore.replication.redis import RedisReplication, parse_redis_url

    redis_dir = None
    out = subprocess.run(
        [os.path.join(REPO, "bin", "redis-test-server"), "start"], capture_output=True, text=True, check=True
    ).stdout.split()
    redis_url, redis_dir = out[0], out[1]
    try:
        url = new_url()
        server = await start_server(reactor, url)
        for batch in history(20, events):
            await server.store.persist_events(batch)
        targets = {s: server.store.generators[s].get_current_token() for s in ("events", "caches")}
        samples: dict[str, list[dict]] = {"tcp": [], "redis": []}
        env = dict(os.environ, PYTHONPATH=REPO)
        for _ in range(runs):
            for transport in ("tcp", "redis"):
                address = str(server.port.getHost().port) if transport == "tcp" else redis_url
                argv = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--transport-worker",
                    url,
                    transport,
                    address,
                    json.dumps(targets),
                ]
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True)
                publisher = None
                if transport == "redis":
                    # Wait for the worker to be subscribed, then publish the history from token 0.
                    from twisted.internet import threads

                    line = await threads.deferToThread(proc.stdout.readline)
                    if line.strip() != "READY":
                        raise RuntimeError(f"redis worker did not start: {line!r}")
                    publisher = RedisReplication(
                        server.store,
                        parse_redis_url(redis_url),
                        "bench",
                        reactor=reactor,
                        page_size=500,
                        replay_from={s: 0 for s in STREAMS},
                    )
                    publisher.start()
                await exited(proc)
                lines = proc.stdout.read().strip().splitlines()
                if publisher is not None:
                    await publisher.stop()
                if proc.returncode != 0 or not lines:
                    raise RuntimeError(f"{transport} worker failed ({proc.returncode})")
                samples[transport].append(json.loads(lines[-1]))
        await server.stopService()
    finally:
        if redis_dir:
            subprocess.run([os.path.join(REPO, "bin", "redis-test-server"), "stop", redis_dir], check=False)
    rows = []
    medians = {t: statistics.median(s["seconds"] for s in got) for t, got in samples.items()}
    for transport, got in samples.items():
        rates = sorted(s["rows"] / s["seconds"] for s in got)
        rows.append(
            [
                transport,
                targets["events"],
                int(got[0]["rdata"]),
                int(got[0]["rows"]),
                medians[transport],
                f"{medians[transport] / medians['tcp']:.2f}x",
                statistics.median(rates),
                rates[0],
                rates[-1],
                statistics.median(s["rows"] / s["cpu"] for s in got),
            ]
        )
    return rows


async def redis_publish(reactor, new_url, events: int, runs: int) -> list[list]:
    """A writer's ``RedisReplication`` publishing its events stream from token
    0 (the announcer a live writer runs, all of it at once), until Redis has
    acknowledged every line: RDATA lines/s, median of ``runs``."""
    from roomstore.replication import metrics
    from roomstore.replication.redis import RedisReplication, parse_redis_url
    from roomstore.store import RoomStore, StoreConfig

    out = subprocess.run(
        [os.path.join(REPO, "bin", "redis-test-server"), "start"], capture_output=True, text=True, check=True
    ).stdout.split()
    redis_url, redis_dir = out[0], out[1]
    try:
        store = await RoomStore.open(new_url(), StoreConfig("master"), reactor=reactor)
        try:
            for batch in history(20, events):
                await store.persist_events(batch)
            publisher = RedisReplication(store, parse_redis_url(redis_url), "benchpub", reactor=reactor, page_size=500)
            publisher.start()
            await publisher.when_ready()
            await publisher.flush()
            await sleep(reactor, 0.5)  # its own REPLICATE heard back and answered
            published = metrics.REDIS_PUBLISHED.labels("RDATA")
            seconds, lines = [], []
            for _ in range(runs):
                before = published._value.get()
                publisher._announced["events"] = 0
                started = time.perf_counter()
                publisher._schedule_announce("events")
                await publisher.flush()
                seconds.append(time.perf_counter() - started)
                lines.append(published._value.get() - before)
            await publisher.stop()
        finally:
            await store.close()
    finally:
        subprocess.run([os.path.join(REPO, "bin", "redis-test-server"), "stop", redis_dir], check=False)
    rates = sorted(n / s for n, s in zip(lines, seconds, strict=True))
    return [[int(lines[0]), statistics.median(seconds), statistics.median(rates), rates[0], rates[-1]]]


# ---------------------------------------------------------------- 2. congestion


class PeakDeque(collections.deque):
    """The pending queue of the slow connection, remembering its peak length
    and the mean line length of the commands in it at that moment."""

    peak = 0
    line_bytes = 0.0

    def append(self, cmd) -> None:
        super().append(cmd)
        if len(self) > self.peak:
            self.peak = len(self)
            if self.peak % 16 == 1:  # cheap enough, often enough
                from roomstore.replication.commands import serialize_command

                head = list(self)[:200]
                self.line_bytes = sum(len(serialize_command(c)) + 1 for c in head) / len(head)


class SlowClient:
    """A client that says hello, then never reads (receive buffer 4 KiB)
    but keeps sending PINGs; ``drain()`` starts reading."""

    def __init__(self, reactor, port: int) -> None:
        self.reactor = reactor
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(b"NAME slow\nPING 0\nREPLICATE\n")
        self.sock.setblocking(False)
        self.closed_by_server = False
        self.buffer = b""
        self.events_token = 0
        self.error = None
        self._ping = task.LoopingCall(self._send_ping)
        self._ping.clock = reactor
        self._ping.start(2.0, now=False)

    def _send_ping(self) -> None:
        try:
            self.sock.send(b"PING 1\n")
        except OSError:
            self.closed_by_server = True

    def read_available(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                self.closed_by_server = True
                return
            if not data:
                self.closed_by_server = True
                return
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                parts = line.split(b" ", 5)
                if parts[0] == b"ERROR":
                    self.error = line.decode()
                elif parts[0] == b"RDATA" and parts[1] == b"events" and parts[3] != b"batch":
                    self.events_token = int(parts[3])
                elif parts[0] == b"POSITION" and parts[1] == b"events":
                    self.events_token = max(self.events_token, int(parts[4]))

    def close(self) -> None:
        if self._ping.running:
            self._ping.stop()
        self.sock.close()


async def congestion_run(reactor, url: str, events: int, max_pending: int | None) -> dict:
    """One writer run with a healthy worker and (unless ``max_pending`` is
    None, the control) a slow client."""
    from roomstore.replication import ReplicationClientFactory, ReplicationConfig
    from roomstore.replication.store_handler import StoreReplicationHandler
    from roomstore.store import RoomStore, StoreConfig

    config = ReplicationConfig(max_pending_commands=max_pending or 10_000, ping_timeout=600.0)
    server = await start_server(reactor, url, config=config)
    worker = await RoomStore.open(url, StoreConfig("healthy", {s: ["master"] for s in STREAMS}), reactor=reactor)
    handler = StoreReplicationHandler(worker)
    healthy = ReplicationClientFactory(handler, "healthy", "bench", clock=reactor, config=config)
    for (stream, instance), token in handler.initial_positions().items():
        healthy.positions.set(stream, instance, token)
    reactor.connectTCP("127.0.0.1", server.port.getHost().port, healthy)
    await until(reactor, lambda: healthy.connection is not None, 30, "healthy worker")
    slow = SlowClient(reactor, server.port.getHost().port) if max_pending is not None else None
    if slow is not None:
        await until(reactor, lambda: [c for c in server.factory.connections if c.peer_name == "slow"], 30, "NAME")
        slow_conn = [c for c in server.factory.connections if c.peer_name == "slow"][0]
        slow_conn.outbound._pending = pending = PeakDeque(slow_conn.outbound._pending)
    from roomstore.replication import metrics

    drops_before = metrics.CONGESTION_DISCONNECTS._value.get()
    baseline_rss = rss_kib()
    peak = {"rss": baseline_rss, "buffer": 0}
    dropped_at = None
    started = time.perf_counter()
    persisted = 0

    def sample() -> None:
        nonlocal dropped_at
        peak["rss"] = max(peak["rss"], rss_kib())
        if slow is None:
            return
        if slow_conn.is_open:
            transport = slow_conn.transport
            buffered = len(transport.dataBuffer) + transport._tempDataLen
            peak["buffer"] = max(peak["buffer"], buffered)
        elif dropped_at is None:
            dropped_at = (time.perf_counter() - started, persisted)

    sampler = task.LoopingCall(sample)
    sampler.clock = reactor
    sampler.start(0.01)
    for batch in history(10, events):
        await server.store.persist_events(batch)
        persisted += len(batch)
    written_s = time.perf_counter() - started
    target = server.store.events_stream.get_current_token()
    await until(reactor, lambda: worker.events_stream.get_current_token() >= target, 120, "healthy catch-up")
    healthy_lag = time.perf_counter() - started - written_s
    await sleep(reactor, 0.3)
    sample()
    result = {
        "max_pending": max_pending,
        "events": persisted,
        "write_s": written_s,
        "healthy_lag_s": healthy_lag,
        "rss_growth_kib": peak["rss"] - baseline_rss,
    }
    if slow is not None:
        result.update(
            peak_pending=pending.peak,
            pending_kib=pending.peak * pending.line_bytes / 1024,
            peak_buffer_kib=peak["buffer"] / 1024,
            dropped_at=dropped_at,
            target=target,
            congestion_drops=metrics.CONGESTION_DISCONNECTS._value.get() - drops_before,
            cursor=slow_conn.session.feed.position("events", "master") if dropped_at is None else None,
        )
        if dropped_at is None:
            # It reads again: it catches up from the database, in pages.
            drain_start = time.perf_counter()
            reader = task.LoopingCall(slow.read_available)
            reader.clock = reactor
            reader.start(0.001)
            await until(reactor, lambda: slow.events_token >= target, 120, "slow client catch-up")
            reader.stop()
            result["catch_up_s"] = time.perf_counter() - drain_start
        slow.close()
    sampler.stop()
    healthy.stop()
    await server.stopService()
    await worker.close()
    return result


async def congestion(reactor, new_url, events: int, settings) -> list[list]:
    rows = []
    control = await congestion_run(reactor, new_url(), events, None)
    rows.append(
        [
            "(no slow client)",
            "-",
            "-",
            "-",
            control["rss_growth_kib"] / 1024,
            "-",
            f"{control['healthy_lag_s']:.2f}",
            "-",
        ]
    )
    for max_pending in settings:
        r = await congestion_run(reactor, new_url(), events, max_pending)
        if r["dropped_at"] is None:
            fate = f"kept; sent up to {r['cursor']} of {r['target']}"
            catch_up = f"{r['catch_up_s']:.2f}"
        else:
            seconds, persisted = r["dropped_at"]
            why = "too many pending commands" if r["congestion_drops"] else "closed"
            fate = f"dropped ({why}) at {seconds:.1f}s, {persisted} events in"
            catch_up = "-"
        rows.append(
            [
                max_pending,
                r["peak_pending"],
                f"{r['pending_kib']:.0f}",
                f"{r['peak_buffer_kib']:.0f}",
                r["rss_growth_kib"] / 1024,
                fate,
                f"{r['healthy_lag_s']:.2f}",
                catch_up,
            ]
        )
    return rows


# ---------------------------------------------------------------- main


def print_profile(title: str, stats_source, top: int = 14) -> None:
    """The functions with the most own time (cProfile tottime) in a profile:
    where the time goes, by function."""
    import pstats

    stats = pstats.Stats(stats_source)
    total = stats.total_tt
    entries = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    print(f"\n  profile, {title}: {total:.2f} s profiled; own time by function")
    for (filename, line, name), (_cc, calls, tottime, _cumtime, _callers) in entries:
        where = f"{os.path.basename(filename)}:{line}({name})" if filename != "~" else name
        print(f"    {100 * tottime / total:5.1f}%  {tottime:7.3f} s  {calls:>9,} calls  {where}")


async def main(reactor, args) -> None:
    databases = bench_databases()
    profiles: list = []
    synapse_rate = None
    if "parse" in args.sections:
        print(
            f"\n0. Parsing: parse_command_from_line on the same {args.parse_lines:,} events RDATA lines (the rows "
            f"EventsStream sends for {args.events:,} persisted events, repeated with later tokens); interleaved "
            f"runs, median of {args.runs}\n"
        )
        synapse_rate = parse_section(
            await parse_rows(reactor, databases[0][1], args.events), args.parse_lines, max(args.runs, 5)
        )
    if "catchup" in args.sections:
        print(
            f"\n1. Catch-up throughput: {args.events} events replayed from token 0 to a worker process over "
            f"loopback TCP (database pages, RDATA, parse, apply); median of {args.runs} runs\n"
        )
        rows = []
        for engine, new_url in databases:
            rows += await throughput(
                reactor,
                engine,
                new_url,
                args.events,
                args.runs,
                args.page_sizes,
                args.profile,
                profiles,
                args.read_ahead,
            )
        headers = [
            "engine",
            "page size",
            "read-ahead",
            "events",
            "RDATA lines",
            "tokens",
            "median s",
            "median lines/s",
            "min lines/s",
            "max lines/s",
            "median tokens/s",
            "lines/worker CPU s",
            "lines/server CPU s",
            "worker reads",
            "KiB/read",
            "worker wake-ups",
            "server wake-ups",
        ]
        if synapse_rate:
            # The goal's ratio: catch-up at the worker over Synapse's parser
            # alone on the same lines (section 0 of this run).
            headers.insert(8, "/ synapse parse")
            for row in rows:
                row.insert(8, f"{row[7] / synapse_rate:.2f}x")
        print_table(headers, rows)
        print(
            "  (lines/s: wall clock at the worker; lines per CPU second of the worker process and of the "
            "server process (its database threads included; PostgreSQL's own process not), which the load "
            "of other processes on the machine does not inflate; reads: the worker's dataReceived calls; "
            "wake-ups: reactor iterations of each process from the connection to the end)"
        )
        for title, server_profile, worker_stats in profiles:
            print_profile(f"server ({title})", server_profile)
            print_profile(f"worker ({title})", worker_stats)
    if "live" in args.sections:
        print(
            f"\n3. Live traffic: a worker process connected and caught up while the writer (this process) persists "
            f"{args.events} events in batches of 50 ({LIVE_WRITER['in_flight']} call(s) in flight, "
            f"validation_processes={LIVE_WRITER['validation_processes']}"
            f"{', in a writer process' if LIVE_WRITER['writer_process'] else ''}); "
            "RDATA lines/s at the worker from its first row to the writer's "
            f"positions, parse and apply included; median of {args.runs} runs\n"
        )
        rows = []
        for engine, new_url in databases:
            rows += await live(reactor, engine, new_url, args.events, args.runs, max(args.page_sizes))
        print_table(
            [
                "engine",
                "writer, rows told",
                "page size",
                "rows written",
                "RDATA lines",
                "writer rows/s",
                "median lines/s",
                "min lines/s",
                "max lines/s",
                "lines/worker CPU s",
                "worker reads",
                "lines/read",
                "worker wake-ups",
            ],
            rows,
        )
        print(
            "  (events, as written: persisted events, the worker cannot get rows faster than the writer validates "
            "and commits them; burst: the same events, the server told once they are all written, through the "
            "same live connection; caches bulk writer: N cache invalidations, one row per stream ID, 1,000 IDs "
            "reserved and committed per transaction as fast as the writer can, the server told as each commit "
            "completes: live traffic bounded by allocation and commit, not by event validation)"
        )
    if "breakdown" in args.sections:
        print(
            f"\n5. Breakdown: each stage of a catch-up alone, in one process, on {args.events} persisted events "
            f"(page size {max(args.page_sizes)}); median of {args.runs} runs\n"
        )
        rows = []
        for engine, new_url in databases:
            rows += await breakdown(reactor, engine, new_url, args.events, args.runs, max(args.page_sizes))
        print_table(["engine", "stage", "lines", "median lines/s", "median lines/CPU s"], rows)
        print(
            "  (CPU: this process, database threads included, PostgreSQL's own processes not; end to end the "
            "server's stages and the worker's run in two processes, side by side)"
        )
    if "transports" in args.sections:
        print(
            f"\n4. Redis vs direct TCP: {args.events} persisted events from token 0 to a worker process, "
            f"the same worker and workload over each transport; median of {args.runs} runs, alternating\n"
        )
        rows = []
        for engine, new_url in databases:
            rows += [[engine, *row] for row in await transports(reactor, new_url, args.events, args.runs)]
        print_table(
            [
                "engine",
                "transport",
                "events",
                "RDATA lines",
                "rows applied",
                "median s",
                "s / TCP's",
                "median rows/s",
                "min rows/s",
                "max rows/s",
                "rows/worker CPU s",
            ],
            rows,
        )
        print(
            "  (rows applied: by the worker, from RDATA lines or read from the database; a Redis worker fills what "
            "it missed from the shared database itself, as it does for the rows a writer persisted before it "
            "connected: RDATA lines count only the rows that came over Redis)"
        )
        print(
            f"\n4b. Publishing on Redis: a writer's announcer sends its {args.events} events' rows from token 0 "
            f"(pages of 500) until Redis acknowledged every line; median of {args.runs} runs\n"
        )
        rows = []
        for engine, new_url in databases:
            rows += [[engine, *row] for row in await redis_publish(reactor, new_url, args.events, args.runs)]
        print_table(["engine", "RDATA lines", "median s", "median lines/s", "min lines/s", "max lines/s"], rows)
    if "congestion" not in args.sections:
        return

    engine, new_url = databases[-1]
    print(
        f"\n2. Congestion ({engine}): the writer persists {args.congestion_events} events; a client that never "
        "reads (but PINGs) is connected next to a healthy worker\n"
    )
    print_table(
        [
            "max_pending_commands",
            "peak pending",
            "pending KiB",
            "peak transport buffer KiB",
            "server peak RSS growth MiB",
            "slow client",
            "healthy worker lag s",
            "slow catch-up s",
        ],
        await congestion(reactor, new_url, args.congestion_events, args.max_pending),
    )
    print(
        "\n(pending KiB: peak pending commands x their mean line length; RSS growth is against the server's RSS "
        "when the writes start, and includes the writer's own caches: compare with the first row)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--transport-worker":
        _, _, url, transport, address, targets = sys.argv
        task.react(
            lambda r: defer.ensureDeferred(transport_worker_main(r, url, transport, address, json.loads(targets)))
        )
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, url, port, targets, page_size = sys.argv
        task.react(
            lambda r: defer.ensureDeferred(
                worker_main(r, url, int(port), None if targets == "-" else json.loads(targets), int(page_size))
            )
        )
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--congestion-events", type=int, default=20_000)
    parser.add_argument("--max-pending", type=int, nargs="+", default=[50, 1_000, 10_000])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--parse-lines", type=int, default=200_000)
    parser.add_argument(
        "--read-ahead",
        type=int,
        nargs="+",
        default=[2],
        help="the server's read_ahead settings for catch-up, taking turns run by run (e.g. 1 2 4)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more run per setting, profiled on both sides (not counted in the figures); "
        "catch-up profiles count CPU time (a loaded machine does not inflate them; the "
        "server's database thread falls in its reactor's poll)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["parse", "catchup", "live", "breakdown", "transports", "congestion"],
        choices=["parse", "catchup", "live", "breakdown", "transports", "congestion"],
    )
    parser.add_argument("--transports-only", action="store_true", help="only section 4 (Redis vs TCP)")
    parser.add_argument(
        "--writer-in-flight",
        type=int,
        default=1,
        help="3: persist_events calls the live event writer keeps in flight (default 1)",
    )
    parser.add_argument(
        "--writer-validation-processes",
        type=int,
        default=None,
        help="3: the live writer store's validation_processes (default: the store's own)",
    )
    parser.add_argument(
        "--writer-process",
        action="store_true",
        help="3: the live writer store's writes in a child process (StoreConfig.writer_process)",
    )
    args = parser.parse_args()
    LIVE_WRITER.update(
        in_flight=args.writer_in_flight,
        validation_processes=args.writer_validation_processes,
        writer_process=args.writer_process,
    )
    if args.transports_only:
        args.sections = ["transports"]
    task.react(lambda r: defer.ensureDeferred(main(r, args)))
