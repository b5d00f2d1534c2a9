"""The Redis bus as the commands that use it see it (``import`` announces
its rows on it, ``serve`` and ``follow`` replicate over it, and so does the
twistd plugin): the TLS options, connecting within a time limit, and
waiting until followers were sent every row."""

from __future__ import annotations

import argparse
import sys

from twisted.internet import defer

from roomstore.cli.common import CliError


def add_redis_tls_options(p: argparse.ArgumentParser) -> None:
    """``--redis-ca``, ``--redis-cert`` and ``--redis-key``, for a command with ``--redis``."""
    p.add_argument(
        "--redis-ca", metavar="FILE", help="with --redis rediss://...: trust this CA (PEM; default: the system's)"
    )
    p.add_argument("--redis-cert", metavar="FILE", help="with rediss://: a client certificate (PEM)")
    p.add_argument("--redis-key", metavar="FILE", help="the private key of --redis-cert (PEM)")


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
    from roomstore.replication.process_services import start_redis
    from roomstore.replication.redis import RedisRefused, shown_url

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
