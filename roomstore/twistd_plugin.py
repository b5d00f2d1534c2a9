"""The twistd plugin's options and service maker: ``twistd -n roomstore
--db URL [options]`` runs what ``roomstore serve`` runs (the writer's store,
served to workers over TCP replication, and with ``--redis URL`` announced on
Redis), with the same options (``tests/test_twistd.py`` compares them).

``twisted/plugins/roomstore_plugin.py``, the drop-in Twisted finds on
``sys.path``, imports ``serviceMaker`` from here; ``pip install .`` installs
it into ``twisted/plugins/`` of site-packages beside Twisted's own plugins.
"""

from __future__ import annotations

from twisted.application.service import IServiceMaker
from twisted.plugin import IPlugin
from twisted.python import usage
from zope.interface import implementer


def _positive_bytes(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be a positive number of bytes")
    return number


class Options(usage.Options):
    synopsis = "[options]  (the options of roomstore serve)"
    optParameters = [
        ["db", None, "sqlite:///var/roomstore.db", "database URL"],
        ["instance", None, "master", "this process's instance name"],
        ["replication-port", None, 9092, "TCP port for replication (0: any free port)", int],
        ["bind", None, "127.0.0.1", "address to listen on (default: loopback only)"],
        ["server-name", None, "localhost", "the name sent to workers in SERVER"],
        ["secret-file", None, None, "require AUTH with the secret on this file's first line"],
        ["metrics-port", None, None, "serve Prometheus metrics on /metrics at this port", int],
        [
            "redis",
            None,
            None,
            "also replicate over this Redis (redis://[:PASSWORD@]host:port, rediss:// for TLS), channel --server-name",
        ],
        ["redis-ca", None, None, "with a rediss:// URL: trust this CA (PEM; default: the system's)"],
        ["redis-cert", None, None, "with a rediss:// URL: a client certificate (PEM)"],
        ["redis-key", None, None, "the private key of --redis-cert (PEM)"],
        ["tls-cert", None, None, "serve replication over TLS with this certificate (PEM; with --tls-key)"],
        ["tls-key", None, None, "the private key of --tls-cert (PEM)"],
        [
            "max-line-length",
            None,
            None,
            "longest replication line sent or accepted, in bytes (default 16384, Synapse's limit)",
            _positive_bytes,
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["stream-writers"] = []

    def opt_stream_writers(self, spec: str) -> None:
        """STREAM=NAME[,NAME...]: the writer instances of a stream (repeatable)"""
        self["stream-writers"].append(spec)


@implementer(IServiceMaker, IPlugin)
class RoomstoreServiceMaker:
    tapname = "roomstore"
    description = "roomstore replication server: a writer store served to workers over TCP replication"
    options = Options

    def makeService(self, options: Options):
        from types import SimpleNamespace

        from roomstore.cli.common import CliError
        from roomstore.cli.redis_bus import redis_tls
        from roomstore.cli.replication import serve_store_config
        from roomstore.replication import ReplicationConfig
        from roomstore.replication.process_services import ReplicationServerService, read_secret_file

        try:
            secret = read_secret_file(options["secret-file"]) if options["secret-file"] else None
        except (OSError, ValueError) as exc:
            raise usage.UsageError(f"--secret-file: {exc}") from None
        length = options["max-line-length"]
        try:
            store_config = serve_store_config(
                SimpleNamespace(
                    instance=options["instance"], stream_writers=options["stream-writers"], redis=options["redis"]
                )
            )
            tls = redis_tls(
                SimpleNamespace(
                    redis=options["redis"],
                    redis_ca=options["redis-ca"],
                    redis_cert=options["redis-cert"],
                    redis_key=options["redis-key"],
                )
            )
            service = ReplicationServerService(
                options["db"],
                port=options["replication-port"],
                bind=options["bind"],
                server_name=options["server-name"],
                instance_name=options["instance"],
                secret=secret,
                metrics_port=options["metrics-port"],
                store_config=store_config,
                redis_url=options["redis"],
                redis_tls=tls,
                tls_cert=options["tls-cert"],
                tls_key=options["tls-key"],
                config=ReplicationConfig() if length is None else ReplicationConfig(max_line_length=length),
            )
        except (CliError, ValueError) as exc:  # ValueError: TLSConfigError, a bind without protection
            raise usage.UsageError(str(exc)) from None
        # Under twistd nothing else notices a failed start-up (database
        # unreachable, port taken): exit instead of running empty.
        service.stop_reactor_on_failure = True
        return service


serviceMaker = RoomstoreServiceMaker()
