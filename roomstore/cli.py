"""``roomstore``: the command line for operators and the main job.

Every command takes ``--db URL`` (default: an embedded SQLite file,
``sqlite:///var/roomstore.db``) and prints JSON, one object a line; progress
and logs go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable

from twisted.internet import defer, task

from roomstore import cli_homeserver, cli_purge, cli_synapse
from roomstore.cli_common import CliError, emit
from roomstore.cli_import import import_file

DEFAULT_DB = "sqlite:///var/roomstore.db"
SAMPLE_PATH = os.path.join(os.path.dirname(__file__), "data", "sample-rooms.jsonl")


async def open_store(
    reactor,
    args,
    create: bool = False,
    read_only: bool = False,
    validation_processes: int = 0,
    server_name: str | None = None,
):
    """The store at ``--db``. Only commands that write (``create=True``)
    create a missing SQLite file: for the others it is a mistyped path.
    ``read_only`` (the read commands): no writer lock, so it runs beside a
    live writer."""
    from roomstore.store import RoomStore, StoreConfig

    writers = stream_writers(args)
    if not read_only:
        check_multi_writer(writers, args)
    config = StoreConfig(
        instance_name=args.instance,
        stream_writers=writers,
        read_only=read_only,
        validation_processes=validation_processes,
        server_name=server_name,
    )
    return await RoomStore.open(args.db, config, reactor=reactor, create=create)


def at_least(least: int, also: tuple[str, ...] = ()) -> Callable[[str], int | str]:
    """An argparse type: an integer no smaller than ``least`` (or one of the words ``also``)."""

    def parse(text: str) -> int | str:
        if text in also:
            return text
        try:
            value = int(text)
        except ValueError:
            words = "".join(f" or {word}" for word in also)
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{words}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}: give {least} or more")
        return value

    return parse


#: ``import --validation-processes auto``: a worker process from this many
#: lines. It takes about 0.4 s to start: at 10,000 events the import was no
#: faster with one, at 40,000 1.2x (CHANGES.md, session 16).
AUTO_WORKER_LINES = 20_000


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_validation_processes(path: str) -> int:
    """1 for a file of ``AUTO_WORKER_LINES`` lines or more where this process
    may use two cores or more, else 0."""
    if usable_cores() < 2:
        return 0
    lines = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            lines += chunk.count(b"\n")
            if lines >= AUTO_WORKER_LINES:
                return 1
    return 0


def check_multi_writer(writers: dict[str, list[str]], args) -> None:
    """Several writers of a stream must hear each other: refuse without Redis."""
    shared = {name: names for name, names in writers.items() if len(names) > 1}
    if shared and not getattr(args, "redis", None):
        name, names = next(iter(sorted(shared.items())))
        raise CliError(
            f"stream {name} has writers {','.join(names)}: a multi-writer deployment needs"
            " PostgreSQL and --redis URL, so that writers and readers hear each other"
        )


def stream_writers(args) -> dict[str, list[str]]:
    """``--stream-writers STREAM=NAME[,NAME...]`` (repeatable) as a mapping."""
    writers: dict[str, list[str]] = {}
    for spec in getattr(args, "stream_writers", None) or ():
        stream, sep, names = spec.partition("=")
        listed = [n.strip() for n in names.split(",") if n.strip()]
        if not sep or not stream.strip() or not listed:
            raise CliError(f"--stream-writers {spec!r}: write STREAM=NAME[,NAME...], e.g. events=w1,w2")
        writers[stream.strip()] = listed
    return writers


# ---------------------------------------------------------------------- init


async def cmd_init(reactor, args) -> int:
    """Create or upgrade the schema; print the version and stream positions."""
    store = await open_store(reactor, args, create=True)
    try:
        await report_positions(store)
    finally:
        await store.close()
    return 0


async def report_positions(store) -> None:
    emit({"db": store.describe_database(), "schema_version": store.schema_version})
    for name in store.stream_names:
        stream = store.stream(name)
        emit({"stream": name, "positions": stream.get_positions(), "current": stream.get_current_token()})


# ---------------------------------------------------------------------- import


async def cmd_import(reactor, args) -> int:
    if not os.path.exists(args.file):
        raise CliError(f"no such file: {args.file}")
    if os.path.isdir(args.file):
        raise CliError(f"{args.file} is a directory: give a JSON-lines file")
    verify_keys = None
    if args.keys:
        from roomstore.pdu.signatures import KeysFileError, load_verify_keys

        try:
            verify_keys = load_verify_keys(args.keys)
        except (OSError, KeysFileError) as exc:
            raise CliError(f"--keys: {exc}") from None
    from roomstore.storage import StorageFullError

    try:
        processes = args.validation_processes
        if processes == "auto":
            processes = auto_validation_processes(args.file)
        store = await open_store(reactor, args, create=True, validation_processes=processes)
    except StorageFullError as exc:
        raise CliError(f"{exc}: free space and run it again") from None
    redis = None
    summary: dict = {}
    try:
        if args.redis:
            redis = await connect_redis(reactor, store, args)
        started = time.monotonic()
        try:
            await import_file(
                store,
                args.file,
                args.batch_size,
                args.progress,
                args.strict,
                verify_keys,
                summary,
                in_flight=args.in_flight,
                trust_source=args.trust_source,
            )
        except StorageFullError as exc:
            # What committed stays (each batch is one transaction); the same
            # import run again skips it as already present.
            emit(dict(summary, complete=False))
            raise CliError(
                f"stopped at line {summary.get('next_line')}: {exc}; {summary['imported']} events"
                " were imported before it and are stored: free space and run the same import again"
                " (what is stored is skipped)"
            ) from None
        if redis is not None:
            await flush_redis(reactor, redis, args)
        summary["seconds"] = round(time.monotonic() - started, 3)
        summary["current_token"] = store.get_current_token()
        emit(summary)
    finally:
        if redis is not None:
            await redis.stop()
        await store.close()
    return 1 if summary["failed"] and args.strict else 0


def redis_tls(args):
    """The ``ClientTLS`` of ``--redis-ca``/``--redis-cert``/``--redis-key`` (None without them)."""
    from roomstore.replication.tls import redis_client_tls

    try:
        return redis_client_tls(
            getattr(args, "redis", None),
            getattr(args, "redis_ca", None),
            getattr(args, "redis_cert", None),
            getattr(args, "redis_key", None),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


async def connect_redis(reactor, store, args, timeout: float = 15.0):
    """``store`` on the Redis bus of ``--redis`` (channel ``--server-name``), connected."""
    from roomstore.replication.redis import RedisRefused, shown_url
    from roomstore.replication.service import start_redis

    try:
        redis = start_redis(store, args.redis, args.server_name or "localhost", reactor, redis_tls(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    ready = redis.when_ready()
    timer = reactor.callLater(timeout, ready.cancel)
    try:
        await ready
    except (defer.CancelledError, RedisRefused) as exc:
        await redis.stop()
        if isinstance(exc, RedisRefused):
            timer.cancel()
            raise CliError(str(exc)) from None
        tls = " (TLS: does its certificate match the host and --redis-ca?)" if redis.tls is not None else ""
        raise CliError(
            f"cannot reach Redis at {shown_url(args.redis)} within {timeout:.0f}s: is redis-server running there?{tls}"
        ) from None
    timer.cancel()
    return redis


async def flush_redis(reactor, redis, args, timeout: float = 60.0) -> None:
    """Wait until followers have been sent every row we wrote; warn (one line) if Redis stays away."""
    from roomstore.replication.redis import shown_url

    flushed = defer.ensureDeferred(redis.flush())
    timer = reactor.callLater(timeout, flushed.cancel)
    try:
        await flushed
        timer.cancel()
    except defer.CancelledError:
        sys.stderr.write(
            f"roomstore import: Redis at {shown_url(args.redis)} unreachable for {timeout:.0f}s: the rows are"
            f" stored, but followers see them only once instance {args.instance!r} is heard again"
            " (its next start) or they restart\n"
        )


# ---------------------------------------------------------------------- reads


def state_as_json(state: dict) -> list[dict]:
    return [{"type": t, "state_key": k, "event_id": e} for (t, k), e in sorted(state.items())]


async def cmd_state(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        try:
            state = await store.get_state_ids(args.event_id, before=args.before)
        except KeyError:
            raise CliError(f"unknown event {args.event_id}") from None
        emit({"event_id": args.event_id, "before": args.before, "state": state_as_json(state)})
    finally:
        await store.close()
    return 0


async def cmd_messages(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        if await store.get_room_version(args.room_id) is None:
            raise CliError(f"unknown room {args.room_id}: no create event of it is stored")
        page = await store.paginate(args.room_id, args.user, args.from_token, args.dir, args.limit)
        for event in page.events:
            emit(event)
        emit({"next_token": page.next_token})
    finally:
        await store.close()
    return 0


async def cmd_sync(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        result = await store.sync(args.user, args.since, args.limit)
        for room_id, events in sorted(result.rooms.items()):
            for event in events:
                emit({"room_id": room_id, "event": event})
        for event in result.membership_events:
            emit({"membership_change": event})
        emit({"next_token": result.next_token})
    finally:
        await store.close()
    return 0


async def cmd_recent(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        result = await store.recent(args.user, args.rooms, args.events, args.cursor)
        for room_id, events in result.rooms:
            emit({"room_id": room_id, "events": events})
        emit({"next_cursor": result.next_cursor})
    finally:
        await store.close()
    return 0


async def cmd_stats(reactor, args) -> int:
    store = await open_store(reactor, args, read_only=True)
    try:
        for row in await store.table_stats():
            emit(row)
    finally:
        await store.close()
    return 0


# ---------------------------------------------------------------------- demo


async def cmd_demo(reactor, args) -> int:
    """The main job on the embedded default: import the bundled sample and
    show each kind of read."""
    store = await open_store(reactor, args, create=True)
    try:
        await report_positions(store)
        summary = await import_file(store, args.sample, progress=args.progress)
        emit({"import": args.sample, **summary})
        room_id = (await store.get_room_ids())[0]
        create_id = (await store.get_current_state_ids(room_id, [("m.room.create", "")]))[("m.room.create", "")]
        creator = (await store.get_event(create_id))["sender"]
        emit(
            {
                "demo": "current state",
                "room_id": room_id,
                "room_version": await store.get_room_version(room_id),
                "state": state_as_json(
                    await store.get_current_state_ids(
                        room_id, [("m.room.topic", ""), ("m.room.history_visibility", "")]
                    )
                ),
            }
        )
        extremities = await store.get_forward_extremities(room_id)
        state = await store.get_state_ids(extremities[0], before=True)
        emit({"demo": "state before a forward extremity", "event_id": extremities[0], "entries": len(state)})
        users = await store.get_users_in_room(room_id)
        emit({"demo": "users in room", "room_id": room_id, "joined": len(users)})
        page = await store.paginate(room_id, creator, None, "b", 5)
        emit(
            {
                "demo": "messages (newest 5)",
                "user": creator,
                "events": [(e["event_id"], e["type"]) for e in page.events],
                "next_token": page.next_token,
            }
        )
        recent = await store.recent(creator, 3, 2, None)
        emit(
            {
                "demo": "recent (2 events in 3 rooms)",
                "user": creator,
                "rooms": [(r, [e["event_id"] for e in evs]) for r, evs in recent.rooms],
            }
        )
        sync = await store.sync(creator, "s0")
        emit(
            {
                "demo": "sync since s0",
                "user": creator,
                "rooms": {r: len(evs) for r, evs in sync.rooms.items()},
                "membership_changes": len(sync.membership_events),
                "next_token": sync.next_token,
            }
        )
        for row in await store.table_stats():
            if row["table"] in ("events", "state_group_deltas", "visibility_memberships", "redactions"):
                emit({"demo": "stats", **row})
    finally:
        await store.close()
    return 0


async def cmd_generate_sample(reactor, args) -> int:
    from roomstore.sample import write_sample

    count = write_sample(args.output, rooms=args.rooms, events_per_room=args.events_per_room, seed=args.seed)
    emit({"written": args.output, "events": count})
    return 0


# ---------------------------------------------------------------------- replication


def serve_store_config(args):
    from roomstore.store import StoreConfig

    writers = stream_writers(args)
    check_multi_writer(writers, args)
    return StoreConfig(instance_name=args.instance, stream_writers=writers)


async def cmd_serve(reactor, args) -> int:
    """Serve the store's streams to workers over TCP replication, until stopped."""
    from roomstore.replication import ReplicationConfig
    from roomstore.replication.service import ReplicationServerService, read_secret_file, run_service
    from roomstore.replication.tls import TLSConfigError

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
    except (OSError, ValueError) as exc:
        raise CliError(f"secret file: {exc}") from None
    if args.max_line_length is not None and args.max_line_length < 1:
        raise CliError("--max-line-length must be a positive number of bytes")
    try:
        service = ReplicationServerService(
            args.db,
            port=args.replication_port,
            bind=args.bind,
            server_name=args.server_name,
            instance_name=args.instance,
            secret=secret,
            metrics_port=args.metrics_port,
            store_config=serve_store_config(args),
            redis_url=args.redis,
            redis_tls=redis_tls(args),
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            config=ReplicationConfig()
            if args.max_line_length is None
            else ReplicationConfig(max_line_length=args.max_line_length),
            reactor=reactor,
        )
    except TLSConfigError as exc:
        raise CliError(str(exc)) from None

    def started() -> None:
        address = service.port.getHost()
        serving = {
            "host": address.host,
            "port": address.port,
            "server_name": args.server_name,
            "secret": bool(secret),
            "tls": service.tls is not None,
        }
        if service.metrics_port_listener is not None:
            serving["metrics_port"] = service.metrics_port_listener.getHost().port
        emit(
            {
                "serving": serving,
                "positions": {n: service.store.stream(n).get_positions() for n in service.store.stream_names},
            }
        )

    from twisted.internet.error import CannotListenError

    try:
        await run_service(reactor, service, started)
    except (CannotListenError, OSError) as exc:  # the port is taken, the address is wrong, ...
        raise CliError(str(exc)) from None
    return 0


async def cmd_follow(reactor, args) -> int:
    """Follow a replication server into a worker store, printing every applied
    row (``{"stream", "instance", "token", "row"}``), until stopped."""
    from roomstore.replication.service import FollowerService, parse_host_port, read_secret_file, run_service

    if (args.server is None) == (args.redis is None):
        raise CliError("give --server HOST:PORT (TCP) or --redis URL, one of them")
    from roomstore.replication.redis import shown_url
    from roomstore.replication.tls import ClientTLS

    if args.tls_ca and not args.server:
        raise CliError("--tls-ca is for --server (TCP); for Redis over TLS give --redis rediss://... --redis-ca FILE")
    try:
        host, port = parse_host_port(args.server) if args.server else (None, None)
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        tls = ClientTLS(args.tls_ca) if args.tls_ca else redis_tls(args)
        if tls is not None:
            tls.options(host or "localhost")  # a file that cannot be used stops the start here, in one line
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None

    def print_rows(stream: str, instance: str, token: int, rows: list) -> None:
        # All rows of a token in one write, flushed before the worker saves
        # its position: a killed worker never saved a token it did not print.
        sys.stdout.write(
            "".join(
                json.dumps(
                    {"stream": stream, "instance": instance, "token": token, "row": row},
                    sort_keys=True,
                    ensure_ascii=False,
                )
                + "\n"
                for row in rows
            )
        )
        sys.stdout.flush()

    service = FollowerService(
        args.db,
        host,
        port,
        name=args.name,
        writer=args.writer,
        expected_server_name=args.server_name,
        secret=secret,
        positions_file=args.positions_file,
        on_applied=None if args.quiet else print_rows,
        redis_url=args.redis,
        stream_writers=stream_writers(args),
        metrics_port=args.metrics_port,
        tls=tls,
        reactor=reactor,
    )

    def started() -> None:
        resume: dict[str, dict[str, int]] = {}
        for (stream, instance), token in sorted(service.resumed_from.items()):
            resume.setdefault(stream, {})[instance] = token
        following = {
            "following": shown_url(args.redis) if args.redis else f"{host}:{port}",
            "name": args.name,
            "resume": resume,
            "tls": tls is not None or bool(args.redis and args.redis.startswith("rediss:")),
        }
        if service.metrics_port_listener is not None:
            following["metrics_port"] = service.metrics_port_listener.getHost().port
        emit(following)

    await run_service(reactor, service, started)
    return 0


COMMANDS: dict[str, Callable] = {
    "init": cmd_init,
    "import": cmd_import,
    "import-synapse": functools.partial(cli_synapse.cmd_import_synapse, open_store=open_store),
    "verify-synapse": functools.partial(cli_synapse.cmd_verify_synapse, open_store=open_store),
    "state": cmd_state,
    "messages": cmd_messages,
    "sync": cmd_sync,
    "recent": cmd_recent,
    "stats": cmd_stats,
    "purge-history": functools.partial(cli_purge.cmd_purge_history, open_store=open_store),
    "purge-room": functools.partial(cli_purge.cmd_purge_room, open_store=open_store),
    "demo": cmd_demo,
    "generate-sample": cmd_generate_sample,
    "serve": cmd_serve,
    "follow": cmd_follow,
    "homeserver": cli_homeserver.cmd_homeserver,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roomstore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--db", default=DEFAULT_DB, help=f"database URL (default {DEFAULT_DB})")
        p.add_argument("--instance", default="master", help="this process's instance name")
        p.add_argument(
            "--stream-writers",
            action="append",
            metavar="STREAM=NAME[,NAME...]",
            help="the writer instances of a stream (repeatable; default: --instance writes every stream)",
        )
        p.add_argument("-v", "--verbose", action="store_true", help="log at info level to stderr")
        return p

    def add_redis_tls(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--redis-ca", metavar="FILE", help="with --redis rediss://...: trust this CA (PEM; default: the system's)"
        )
        p.add_argument("--redis-cert", metavar="FILE", help="with rediss://: a client certificate (PEM)")
        p.add_argument("--redis-key", metavar="FILE", help="the private key of --redis-cert (PEM)")

    add("init", "create or upgrade the schema; print schema version and stream positions")
    p = add("import", "import events from a JSON-lines file")
    p.add_argument("file", help='JSON lines: one event a line, a bare PDU or {"room_version": ..., "event": {...}}')
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=100,
        metavar="N",
        help="events per persist_events call, stored whole or not at all (default 100; the store may"
        " commit several in one transaction)",
    )
    p.add_argument(
        "--in-flight",
        type=at_least(1),
        default=8,
        metavar="N",
        help="batches handed to the store at once: it validates the next while it writes, and commits"
        " several in one transaction (default 8; 1: one batch at a time)",
    )
    p.add_argument(
        "--validation-processes",
        type=at_least(0, also=("auto",)),
        default="auto",
        metavar="N",
        help="validate events in N worker processes, on other cores; 0: on a thread of this process"
        f" (default auto: 1 for a file of {AUTO_WORKER_LINES:,} lines or more on two cores or more,"
        " else 0; a worker takes about half a second to start)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse an event whose content hash does not match (default: store it redacted);"
        " exit 1 if any event failed",
    )
    p.add_argument(
        "--trust-source",
        action="store_true",
        help="store the events unchecked against their rooms' authorization rules: only for a file from a"
        " server that checked them (default: an event breaking the rules is stored rejected and"
        " reported)",
    )
    p.add_argument(
        "--keys",
        metavar="FILE",
        help='check signatures against these verify keys: a JSON object, server name -> {"ed25519:ID":'
        ' "<unpadded base64 public key>"} (or the server\'s /_matrix/key/v2/server response);'
        " a bad signature refuses the event; without it signatures are not checked",
    )
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p.add_argument(
        "--redis",
        help="announce the imported rows on this Redis (redis://[:PASSWORD@]host:port;"
        " rediss:// for TLS) to live followers",
    )
    p.add_argument("--server-name", default="localhost", help="the homeserver's name: the Redis channel")
    cli_synapse.add_parsers(add)
    cli_homeserver.add_parsers(add)
    add_redis_tls(p)
    p = add("state", "the state at an event")
    p.add_argument("event_id", help="the event whose state to show")
    p.add_argument("--before", action="store_true", help="the state before the event, not after")
    p = add("messages", "a page of a room's timeline as a user sees it")
    p.add_argument("room_id", help="the room to page through")
    p.add_argument("--user", required=True, help="the user the page is shown to (history visibility applies)")
    p.add_argument(
        "--from",
        dest="from_token",
        default=None,
        help="a t<topo>-<stream> or stream token to start from (default: the newest end for b, the start for f)",
    )
    p.add_argument("--dir", choices=["b", "f"], default="b", help="b: backwards, newest first (default); f: forwards")
    p.add_argument("--limit", type=int, default=10, help="events per page (default 10)")
    p = add("sync", "new events for a user since a token; without --since an initial sync")
    p.add_argument("--user", required=True, help="the syncing user")
    p.add_argument(
        "--since",
        default=None,
        help="a next_token from an earlier sync (default: an initial sync, the newest events of each room)",
    )
    p.add_argument("--limit", type=int, default=10, help="events per room on an initial sync (default 10)")
    p = add("recent", "the newest events in a user's most recently active rooms")
    p.add_argument("--user", required=True, help="the user whose joined rooms to show")
    p.add_argument("--rooms", type=int, default=5, help="how many of the most recently active rooms (default 5)")
    p.add_argument("--events", type=int, default=10, help="newest events per room (default 10)")
    p.add_argument("--cursor", default=None, help="a next_cursor from an earlier page, for the next rooms")
    add("stats", "rows and bytes per table")
    cli_purge.add_parsers(add)
    p = add("demo", "the main job: import the bundled sample and show the reads")
    p.add_argument(
        "--sample", default=SAMPLE_PATH, help="the JSON-lines history to import (default: the bundled sample)"
    )
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p = add("generate-sample", "write a generated sample history (JSON lines)")
    p.add_argument("output", help="the JSON-lines file to write")
    p.add_argument("--rooms", type=int, default=5, help="rooms to generate (default 5)")
    p.add_argument("--events-per-room", type=int, default=800, help="events per room, about (default 800)")
    p.add_argument("--seed", type=int, default=7, help="random seed: the same seed writes the same file (default 7)")
    p = add("serve", "serve the store's streams to workers over TCP replication (runs until stopped)")
    p.add_argument("--replication-port", type=int, default=9092, help="TCP port (default 9092; 0: any free port)")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    p.add_argument("--server-name", default="localhost", help="the name sent to workers in SERVER")
    p.add_argument("--secret-file", help="require AUTH with the secret on this file's first line")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on /metrics")
    p.add_argument(
        "--redis",
        help="also replicate over this Redis (redis://[:PASSWORD@]host:port; rediss:// for TLS), channel --server-name",
    )
    add_redis_tls(p)
    p.add_argument("--tls-cert", metavar="FILE", help="serve over TLS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--max-line-length",
        type=int,
        default=None,
        metavar="BYTES",
        help="longest replication line sent or accepted, in bytes (default 16384, Synapse's limit;"
        " a longer cache invalidation is split over several lines)",
    )
    p = add("follow", "follow a replication server into a worker store, printing applied rows (runs until stopped)")
    p.add_argument("--server", help="the replication server, HOST:PORT (or --redis)")
    p.add_argument(
        "--redis",
        help="follow every writer over this Redis (redis://[:PASSWORD@]host:port;"
        " rediss:// for TLS), channel --server-name",
    )
    add_redis_tls(p)
    p.add_argument("--tls-ca", metavar="FILE", help="connect to --server over TLS, trusting this CA (PEM)")
    p.add_argument("--name", default="worker1", help="this worker's instance name (--instance is not used)")
    p.add_argument("--writer", default="master", help="the instance writing the streams (default master)")
    p.add_argument(
        "--server-name",
        default=None,
        help="refuse a server that names itself otherwise; with --redis, the channel (default localhost)",
    )
    p.add_argument("--secret-file", help="send AUTH with the secret on this file's first line")
    p.add_argument("--positions-file", help="save positions here after each token; resume from it on start")
    p.add_argument("--quiet", action="store_true", help="do not print applied rows")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (positions applied per writer, Redis state) on 127.0.0.1",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command]
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    level = LogLevel.info if args.verbose else LogLevel.warn
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [LogLevelFilterPredicate(defaultLogLevel=level)])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)

    async def run_command(reactor):
        try:
            code = await handler(reactor, args) or 0
        except CliError as exc:
            sys.stderr.write(f"roomstore {args.command}: {exc}\n")
            code = 2
        except BrokenPipeError:
            # The reader left (``roomstore stats | head``): leave quietly, as
            # Unix tools do (128 + SIGPIPE), with nothing left to flush at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 141
        except Exception as exc:
            # Errors the store raises for bad input carry a clear message.
            from roomstore.events.tokens import InvalidToken
            from roomstore.storage import DatabaseConfigError, DatabaseUnavailableError, SchemaError, StorageFullError

            if isinstance(exc, (DatabaseUnavailableError, StorageFullError)):
                sys.stderr.write(f"roomstore {args.command}: {exc}\n")
                code = 2
            elif isinstance(exc, (InvalidToken, DatabaseConfigError, SchemaError, ValueError)):
                sys.stderr.write(f"roomstore {args.command}: {type(exc).__name__}: {exc}\n")
                code = 2
            elif args.verbose:
                raise
            else:
                # Anything else still gets one line; -v shows the traceback.
                reason = " ".join(str(exc).split()) or "no message"
                sys.stderr.write(
                    f"roomstore {args.command}: {type(exc).__name__}: {reason} (run again with -v for the traceback)\n"
                )
                code = 1
        if code:
            raise SystemExit(code)  # react() exits with a SystemExit's code

    task.react(lambda reactor: defer.ensureDeferred(run_command(reactor)), [])


if __name__ == "__main__":
    main()
