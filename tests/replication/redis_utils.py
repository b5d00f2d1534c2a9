"""Real Redis servers for tests (never a mock).

``bin/test`` starts one throwaway server and exports its URL as
``ROOMSTORE_TEST_REDIS`` (and the binary as ``ROOMSTORE_REDIS_SERVER``).
Tests that only publish and subscribe share it, each on a channel of its own;
tests that stop and restart Redis start a private :class:`RedisServer`.
Without a server the tests fail with what to do: they never skip.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time

_channels = itertools.count()


def shared_redis_url(test) -> str:
    url = os.environ.get("ROOMSTORE_TEST_REDIS", "")
    if not url:
        test.fail("no Redis: run the tests with bin/test, which starts one (ROOMSTORE_TEST_REDIS)")
    return url


def fresh_channel() -> str:
    """A channel no other test (or test run) publishes on."""
    return f"hs{os.getpid()}x{next(_channels)}.example"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """A private redis-server process on a fixed loopback port; ``stop`` and
    ``start`` again (a restart) keep the port, so clients reconnect to it.

    ``password``: ``--requirepass``. ``tls``: a ``tests.replication.certs.Certs``:
    TLS on :attr:`tls_port` (``rediss://`` in :attr:`tls_url`), client
    certificates signed by its CA required, beside the plaintext port."""

    def __init__(self, test, password: str | None = None, tls=None) -> None:
        binary = os.environ.get("ROOMSTORE_REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            test.fail(f"no redis-server at {binary}: apt-get install redis-server (bin/setup does)")
        self.binary = binary
        self.port = _free_port()
        self.directory = tempfile.mkdtemp(prefix="roomstore-redis-")
        self.password = password
        self.tls = tls
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}"
        self.tls_port = _free_port() if tls is not None else None
        self.tls_url = f"rediss://{auth}127.0.0.1:{self.tls_port}" if tls is not None else None
        self.process: subprocess.Popen | None = None
        self.starts = 0
        test.addCleanup(self.close)

    def start(self, timeout: float = 10.0) -> None:
        assert self.process is None, "already running"
        log = open(os.path.join(self.directory, f"redis{self.starts}.log"), "wb")
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.directory,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args += [
                "--tls-port",
                str(self.tls_port),
                "--tls-cert-file",
                self.tls.server_cert,
                "--tls-key-file",
                self.tls.server_key,
                "--tls-ca-cert-file",
                self.tls.ca,
                "--tls-auth-clients",
                "yes",
            ]
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {self.port} did not start (see {self.directory})")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (SIGKILL: clients see their connections drop)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
