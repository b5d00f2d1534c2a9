"""A real Synapse homeserver on loopback, as a test oracle.

``bin/test`` starts two (one on SQLite, one on the test PostgreSQL server)
with ``python -m tests.synapse_server start [--postgres URL]`` and hands the
tests their folders in ``ROOMSTORE_TEST_SYNAPSE`` and
``ROOMSTORE_TEST_SYNAPSE_PG``; ``stop DIR`` ends one. Synapse runs from its
own virtualenv (``.venv-synapse``, made by ``bin/setup``): its dependency
pins exclude the txredisapi that roomstore uses, so the two cannot share one.

Each folder holds ``server.json`` (the client API's base URL, the server
name, the registration secret and Synapse's database: a SQLite path or a
libpq URL), which :class:`SynapseServer` reads. The client calls are plain
blocking HTTP (urllib): a test builds its history first, then reads it back
through roomstore. Rate limits are raised so a test can send quickly; the
server talks to nobody (no federation listener, no trusted key servers).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNAPSE_PYTHON = os.path.join(ROOT, ".venv-synapse", "bin", "python")
SERVER_NAME = "synapse.test"

#: Per-second rates and bursts high enough that no test call is limited.
_UNLIMITED = {"per_second": 10000, "burst_count": 10000}


class SynapseError(Exception):
    """A client API call failed: ``status`` and Synapse's ``errcode``."""

    def __init__(self, status: int, body: dict, what: str):
        self.status = status
        self.errcode = body.get("errcode")
        super().__init__(f"{what}: HTTP {status} {body}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(folder: str, port: int, database: dict) -> dict:
    """Synapse's configuration (JSON is YAML), with fresh secrets."""
    return {
        "server_name": SERVER_NAME,
        "pid_file": os.path.join(folder, "homeserver.pid"),
        "listeners": [
            {
                "port": port,
                "bind_addresses": ["127.0.0.1"],
                "type": "http",
                "tls": False,
                "x_forwarded": False,
                "resources": [{"names": ["client"], "compress": False}],
            }
        ],
        "database": database,
        "log_config": os.path.join(folder, "log.yaml"),
        "media_store_path": os.path.join(folder, "media"),
        "registration_shared_secret": os.urandom(16).hex(),
        "macaroon_secret_key": os.urandom(16).hex(),
        "form_secret": os.urandom(16).hex(),
        "signing_key_path": os.path.join(folder, "signing.key"),
        "report_stats": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "enable_registration": False,
        "rc_message": _UNLIMITED,
        "rc_registration": _UNLIMITED,
        "rc_login": {"address": _UNLIMITED, "account": _UNLIMITED, "failed_attempts": _UNLIMITED},
        "rc_joins": {"local": _UNLIMITED, "remote": _UNLIMITED},
        "rc_joins_per_room": _UNLIMITED,
        "rc_invites": {"per_room": _UNLIMITED, "per_user": _UNLIMITED, "per_issuer": _UNLIMITED},
        "rc_admin_redaction": _UNLIMITED,
        "rc_room_creation": _UNLIMITED,
        # Synapse's five-minute timer sends a dummy event into any room with
        # more than ten forward extremities (the forked room has 15): the test
        # histories would grow at a moment no test chooses.
        "cleanup_extremities_with_dummy_events": False,
    }


_LOG_CONFIG = """version: 1
formatters:
  precise: {format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(message)s'}
handlers:
  file: {class: logging.FileHandler, formatter: precise, filename: LOGFILE, encoding: utf8}
root: {level: WARNING, handlers: [file]}
disable_existing_loggers: false
"""


def _pg_database(pg_url: str) -> tuple[dict, str]:
    """Create a fresh database for Synapse on the test server: its args, URL."""
    import psycopg2  # the test environment's

    name = "synapse_" + os.urandom(4).hex()
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        # Synapse refuses a database whose collation is not C.
        cur.execute(f"CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'")
    conn.close()
    parts = urllib.parse.urlsplit(pg_url)
    args = {
        "user": parts.username or "postgres",
        "host": parts.hostname,
        "port": parts.port or 5432,
        "database": name,
        "cp_min": 1,
        "cp_max": 5,
    }
    url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/" + name, "", ""))
    return {"name": "psycopg2", "args": args}, url


def start(pg_url: str | None = None, timeout: float = 90.0, extra_config: dict | None = None) -> str:
    """Start a Synapse in a fresh folder; return the folder. ``extra_config``:
    top-level options added to (or replacing) the tests' configuration."""
    if not os.path.exists(SYNAPSE_PYTHON):
        raise RuntimeError(f"no Synapse virtualenv at {SYNAPSE_PYTHON} (run bin/setup)")
    folder = tempfile.mkdtemp(prefix="roomstore-synapse.")
    port = _free_port()
    if pg_url:
        database, db_url = _pg_database(pg_url)
    else:
        db_path = os.path.join(folder, "homeserver.db")
        database, db_url = {"name": "sqlite3", "args": {"database": db_path}}, db_path
    config = {**_config(folder, port, database), **(extra_config or {})}
    with open(os.path.join(folder, "log.yaml"), "w") as f:
        f.write(_LOG_CONFIG.replace("LOGFILE", os.path.join(folder, "homeserver.log")))
    config_path = os.path.join(folder, "homeserver.yaml")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    keys = subprocess.run(
        [*_run_command(folder), "--generate-keys"], capture_output=True, cwd=folder, env=_synapse_env()
    )
    if keys.returncode:
        tail = (keys.stderr or keys.stdout).decode("utf-8", "replace").strip().splitlines()[-3:]
        raise RuntimeError(f"Synapse --generate-keys failed ({keys.returncode}): {' / '.join(tail)}")
    info = {
        "base_url": f"http://127.0.0.1:{port}",
        "server_name": SERVER_NAME,
        "shared_secret": config["registration_shared_secret"],
        "database": db_url,
        "engine": "postgresql" if pg_url else "sqlite",
    }
    _launch(folder, info, timeout)
    return folder


def restart(folder: str, timeout: float = 90.0) -> None:
    """Stop the Synapse of ``folder`` and start it again on the same
    configuration and database (its caches gone: what it serves next it
    reads from the database)."""
    with open(os.path.join(folder, "server.json")) as f:
        info = json.load(f)
    _end(info["pid"])
    _launch(folder, info, timeout)


def _synapse_env() -> dict:
    """Our environment without PYTHONPATH: Synapse runs from its own
    virtualenv, and a path into ours (trial's workers inherit one) would show
    it our txredisapi, which its pin check refuses."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run_command(folder: str) -> list[str]:
    return [SYNAPSE_PYTHON, "-m", "synapse.app.homeserver", "--config-path", os.path.join(folder, "homeserver.yaml")]


def _launch(folder: str, info: dict, timeout: float) -> None:
    """Run Synapse from ``folder`` until its client API answers; record its pid in server.json."""
    log = open(os.path.join(folder, "stdout.log"), "ab")
    proc = subprocess.Popen(
        _run_command(folder),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
        start_new_session=True,
        env=_synapse_env(),
    )
    base_url = info["base_url"]
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"Synapse exited with {proc.returncode}; see {folder}/stdout.log")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"Synapse did not answer within {timeout:.0f} s; see {folder}/stdout.log")
        time.sleep(0.2)
    with open(os.path.join(folder, "server.json"), "w") as f:
        json.dump({**info, "pid": proc.pid}, f)


def _gone(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our child (restarted here): reap it
            return True
    except ChildProcessError:
        pass  # started by another process
    try:
        os.kill(pid, 0)
    except OSError:
        return True
    return False


def _end(pid: int) -> None:
    """SIGTERM, then SIGKILL after 10 s; returns once the process is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    for _ in range(100):
        if _gone(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return
    for _ in range(50):
        if _gone(pid):
            return
        time.sleep(0.1)


def stop(folder: str) -> None:
    """Stop the Synapse of ``folder`` and remove the folder (a PostgreSQL
    database goes with its throwaway server)."""
    try:
        with open(os.path.join(folder, "server.json")) as f:
            pid = json.load(f)["pid"]
        _end(pid)
    except (OSError, ValueError, KeyError):
        pass
    shutil.rmtree(folder, ignore_errors=True)


class SynapseServer:
    """A running Synapse (from its folder): its database and its client API."""

    def __init__(self, folder: str):
        self.folder = folder
        with open(os.path.join(folder, "server.json")) as f:
            info = json.load(f)
        self.base_url: str = info["base_url"]
        self.server_name: str = info["server_name"]
        self.shared_secret: str = info["shared_secret"]
        #: Synapse's database: a SQLite file's path or a libpq URL.
        self.database: str = info["database"]
        self.engine: str = info["engine"]

    @classmethod
    def from_env(cls, variable: str) -> SynapseServer:
        folder = os.environ.get(variable)
        if not folder or not os.path.exists(os.path.join(folder, "server.json")):
            raise RuntimeError(f"{variable} names no running Synapse: run the tests with bin/test, which starts it")
        return cls(folder)

    @property
    def database_url(self) -> str:
        """Synapse's database as ``import-synapse --from`` takes it."""
        return self.database if self.engine == "postgresql" else "sqlite:///" + self.database

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = None, query: dict | None = None
    ) -> dict:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", "Bearer " + token)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"body": raw.decode("utf-8", "replace")}
            raise SynapseError(err.code, payload, f"{method} {path}") from None

    def register(self, localpart: str, admin: bool = False) -> SynapseUser:
        """Register a user through the shared-secret admin API; log them in."""
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        password = "pw-" + localpart
        mac = hmac.new(self.shared_secret.encode(), digestmod=hashlib.sha1)
        mac.update(
            b"\x00".join([nonce.encode(), localpart.encode(), password.encode(), b"admin" if admin else b"notadmin"])
        )
        result = self.request(
            "POST",
            "/_synapse/admin/v1/register",
            {
                "nonce": nonce,
                "username": localpart,
                "password": password,
                "admin": admin,
                "mac": mac.hexdigest(),
            },
        )
        return SynapseUser(self, result["user_id"], result["access_token"])


class SynapseUser:
    """One logged-in user: the client-server calls the tests make."""

    def __init__(self, server: SynapseServer, user_id: str, token: str):
        self.server = server
        self.user_id = user_id
        self.token = token
        self._txn = 0

    def _call(self, method: str, path: str, body: Any = None, query: dict | None = None) -> dict:
        return self.server.request(method, path, body, self.token, query)

    def create_room(self, room_version: str | None = None, preset: str = "private_chat", **extra: Any) -> str:
        body: dict = {"preset": preset, **extra}
        if room_version is not None:
            body["room_version"] = room_version
        return self._call("POST", "/_matrix/client/v3/createRoom", body)["room_id"]

    def _room(self, room_id: str) -> str:
        return "/_matrix/client/v3/rooms/" + urllib.parse.quote(room_id, safe="")

    def send(self, room_id: str, body: str, event_type: str = "m.room.message") -> str:
        self._txn += 1
        path = f"{self._room(room_id)}/send/{event_type}/t{self._txn}-{time.monotonic_ns()}"
        return self._call("PUT", path, {"msgtype": "m.text", "body": body})["event_id"]

    def state(self, room_id: str, event_type: str, content: dict, state_key: str = "") -> str:
        path = f"{self._room(room_id)}/state/{event_type}/{urllib.parse.quote(state_key, safe='')}"
        return self._call("PUT", path, content)["event_id"]

    def get_state(self, room_id: str, event_type: str, state_key: str = "") -> dict:
        return self._call("GET", f"{self._room(room_id)}/state/{event_type}/{urllib.parse.quote(state_key, safe='')}")

    def invite(self, room_id: str, user_id: str) -> None:
        self._call("POST", f"{self._room(room_id)}/invite", {"user_id": user_id})

    def join(self, room_id: str) -> None:
        self._call("POST", f"{self._room(room_id)}/join", {})

    def leave(self, room_id: str) -> None:
        self._call("POST", f"{self._room(room_id)}/leave", {})

    def kick(self, room_id: str, user_id: str, reason: str = "kicked") -> None:
        self._call("POST", f"{self._room(room_id)}/kick", {"user_id": user_id, "reason": reason})

    def ban(self, room_id: str, user_id: str, reason: str = "banned") -> None:
        self._call("POST", f"{self._room(room_id)}/ban", {"user_id": user_id, "reason": reason})

    def unban(self, room_id: str, user_id: str) -> None:
        self._call("POST", f"{self._room(room_id)}/unban", {"user_id": user_id})

    def redact(self, room_id: str, event_id: str, reason: str = "redacted") -> str:
        self._txn += 1
        path = (
            f"{self._room(room_id)}/redact/{urllib.parse.quote(event_id, safe='')}/r{self._txn}-{time.monotonic_ns()}"
        )
        return self._call("PUT", path, {"reason": reason})["event_id"]

    def messages_back(self, room_id: str, page: int = 50) -> list[str] | SynapseError:
        """Every event ID ``/messages`` gives this user, paging back from the
        end of the room to its start (newest first); the error where Synapse
        refuses the user outright."""
        ids: list[str] = []
        query: dict = {"dir": "b", "limit": page}
        while True:
            try:
                result = self._call("GET", f"{self._room(room_id)}/messages", query=query)
            except SynapseError as err:
                if ids:
                    raise
                return err
            ids.extend(ev["event_id"] for ev in result.get("chunk", []))
            if "end" not in result:
                return ids
            query = {"dir": "b", "limit": page, "from": result["end"]}


def exclusive(server: SynapseServer):
    """A lock file held while a test writes to this Synapse or needs nobody
    else to (the compaction tests compare its whole state tables before and
    after): tests in other trial workers that take it wait. Returns the open
    file; closing it lets go."""
    handle = open(os.path.join(server.folder, "exclusive.lock"), "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


class SharedHistory:
    """A history built once per Synapse and shared by every test process
    (the client API is the slow part): the first caller builds it under a
    file lock in the server's folder and writes what it made as JSON; the
    others read that."""

    def __init__(self, server: SynapseServer, name: str):
        self.server = server
        self.path = os.path.join(server.folder, f"history-{name}.json")

    def get(self, build) -> dict:
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(self.path):
                with open(self.path) as f:
                    return json.load(f)
            with exclusive(self.server):
                made = build(self.server)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(made, f)
            os.replace(tmp, self.path)
            return made


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        pg_url = argv[2] if argv[1:2] == ["--postgres"] and len(argv) > 2 else None
        try:
            folder = start(pg_url)
        except Exception as exc:  # one line for bin/test
            print(f"synapse-test-server: {exc}", file=sys.stderr)
            return 1
        print(folder)
        return 0
    if argv[:1] == ["stop"] and len(argv) == 2:
        stop(argv[1])
        return 0
    print("usage: python -m tests.synapse_server start [--postgres URL] | stop DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
