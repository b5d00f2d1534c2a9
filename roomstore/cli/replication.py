"""``roomstore serve`` and ``follow``: the two ends of replication, each a
service that runs until stopped (``roomstore.replication.process_services``), with
the one JSON line that says it is up."""

from __future__ import annotations

import json
import sys

from roomstore.cli.common import CliError, check_multi_writer, emit, stream_writers
from roomstore.cli.redis_bus import add_redis_tls_options, redis_tls


def add_parsers(add) -> None:
    """Add the two commands through the command line's ``add(name, help)``."""
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
    add_redis_tls_options(p)
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
    add_redis_tls_options(p)
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


def serve_store_config(args):
    from roomstore.store import StoreConfig

    writers = stream_writers(args)
    check_multi_writer(writers, args)
    return StoreConfig(instance_name=args.instance, stream_writers=writers)


async def cmd_serve(reactor, args) -> int:
    """Serve the store's streams to workers over TCP replication, until stopped."""
    from roomstore.replication import ReplicationConfig
    from roomstore.replication.process_services import ReplicationServerService, read_secret_file, run_service
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
    from roomstore.replication.process_services import FollowerService, parse_host_port, read_secret_file, run_service

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
