"""``roomstore homeserver``: the command line of ``roomstore.homeserver``.
``roomstore.cli`` registers it."""

from __future__ import annotations

import ipaddress

from twisted.internet import defer

from roomstore.cli.common import CliError, emit


def add_parsers(add) -> None:
    """Add the command through ``cli``'s ``add(name, help)``."""
    p = add("homeserver", "run a single-server Matrix homeserver (client-server API, no federation) on the store")
    p.add_argument(
        "--server-name", required=True, metavar="NAME", help="the server's name: users are @name:NAME, rooms !...:NAME"
    )
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8008, help="port to listen on (default 8008; 0: any free one)")
    p.add_argument(
        "--open-registration",
        action="store_true",
        help="let anyone register (m.login.dummy) though --bind is not a loopback address; on"
        " loopback registration is open anyway",
    )
    p.add_argument(
        "--make-admin",
        metavar="USER_ID",
        help="make this registered user a server admin (the admin API: purge history, delete rooms), then exit"
        " without serving",
    )


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


async def cmd_homeserver(reactor, args) -> int:
    """Serve the client-server API until stopped (SIGINT/SIGTERM)."""
    from twisted.internet.error import CannotListenError

    from roomstore.homeserver import Homeserver

    if args.stream_writers:
        raise CliError("--stream-writers: the homeserver writes every stream itself (one process, no workers)")
    registration_open = args.open_registration or _loopback(args.bind)
    hs = await Homeserver.open(
        args.db, args.server_name, registration_open=registration_open, reactor=reactor, instance_name=args.instance
    )
    if args.make_admin is not None:
        try:
            if not await hs.accounts.set_admin(args.make_admin):
                raise CliError(f"no user {args.make_admin} is registered on this server")
        finally:
            await hs.close()
        emit({"admin": args.make_admin})
        return 0
    try:
        port = hs.listen(args.port, args.bind, reactor)
    except CannotListenError as exc:
        await hs.close()
        raise CliError(str(exc)) from None

    async def stop() -> None:
        await port.stopListening()
        await hs.close()

    reactor.addSystemEventTrigger("before", "shutdown", lambda: defer.ensureDeferred(stop()))
    address = port.getHost()
    emit(
        {
            "serving": {
                "host": address.host,
                "port": address.port,
                "server_name": args.server_name,
                "db": hs.store.describe_database(),
                "registration_open": registration_open,
            }
        }
    )
    lost = hs.store.writer_lock_lost()
    if lost is not None:
        raise await lost
    await defer.Deferred()  # fires never: the reactor stopping ends the process
    return 0
