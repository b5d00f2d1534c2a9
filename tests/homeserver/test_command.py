"""``roomstore homeserver`` as a process of its own, as a client meets it:
it prints where it serves, serves clients, stops on SIGTERM, and a restart
on the same database keeps accounts, sessions and rooms."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from twisted.internet import threads

from tests.db import on_both_engines
from tests.homeserver.harness import Client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(url: str) -> tuple[subprocess.Popen, dict]:
    """The command on a free port, and its ``serving`` line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "roomstore.cli",
            "homeserver",
            "--db",
            url,
            "--server-name",
            "test.local",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"roomstore homeserver exited {proc.returncode}: {proc.stderr.read()}")
    return proc, json.loads(line)["serving"]


def make_admin(url: str, user_id: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    command = ["homeserver", "--db", url, "--server-name", "test.local", "--make-admin", user_id]
    return subprocess.run(
        [sys.executable, "-m", "roomstore.cli", *command], capture_output=True, text=True, env=env, timeout=120
    )


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code, proc.stderr.read()


@on_both_engines
class CommandTests:
    async def start_command(self, url: str):
        proc, serving = await threads.deferToThread(start, url)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        return proc, serving

    async def test_serves_stops_and_restarts(self):
        url = self.new_database_url()
        proc, serving = await self.start_command(url)
        self.assertEqual(
            (serving["host"], serving["server_name"], serving["registration_open"]), ("127.0.0.1", "test.local", True)
        )
        base = f"http://127.0.0.1:{serving['port']}"
        answer = await Client(base).ok(
            "POST", "/register", {"username": "alice", "password": "pw", "auth": {"type": "m.login.dummy"}}
        )
        alice = Client(base, answer["access_token"])
        room = (await alice.ok("POST", "/createRoom", {"name": "kept"}))["room_id"]
        first = await alice.send(room, "t1", "before the restart")
        code, err = await threads.deferToThread(stop, proc)
        self.assertEqual(code, 0, err)

        # --make-admin: an admin from then on (the admin API answers her); an unknown user: one line, exit 2.
        made = await threads.deferToThread(make_admin, url, "@alice:test.local")
        self.assertEqual((made.returncode, json.loads(made.stdout)), (0, {"admin": "@alice:test.local"}))
        made = await threads.deferToThread(make_admin, url, "@nobody:test.local")
        self.assertEqual(made.returncode, 2)  # a CliError
        self.assertEqual(len(made.stderr.strip().splitlines()), 1, made.stderr)

        proc, serving = await self.start_command(url)
        alice.base = f"http://127.0.0.1:{serving['port']}"
        self.assertEqual(await alice.send(room, "t1", "retried after the restart"), first)
        self.assertEqual(await alice.ok("GET", f"/rooms/{room}/state/m.room.name/"), {"name": "kept"})
        second = await alice.send(room, "t2", "after")  # built on the room's ends, signed with the same key
        page = await alice.ok("GET", f"/rooms/{room}/messages", query={"dir": "b", "limit": "2"})
        self.assertEqual([e["event_id"] for e in page["chunk"]], [second, first])
        status, answer = await alice.call("GET", "/v1/purge_history_status/none", prefix="/_synapse/admin")
        self.assertEqual((status, answer["errcode"]), (404, "M_NOT_FOUND"))  # an admin: past the check
        code, err = await threads.deferToThread(stop, proc)
        self.assertEqual(code, 0, err)


@on_both_engines
class ApiDocTests:
    async def test_the_documented_homeserver_example_runs(self):
        import re

        from twisted.internet import reactor

        with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as handle:
            section = handle.read().split("\n## A homeserver on the store\n", 1)[1].split("\n## ", 1)[0]
        [source] = re.findall(r"```python\n(.*?)```", section, re.S)
        namespace: dict = {}
        exec(compile(source, "docs/api.md", "exec"), namespace)
        hs, port = await namespace["serve"](self.new_database_url(), reactor)
        try:
            versions = await Client(f"http://127.0.0.1:{port.getHost().port}").ok(
                "GET", "/versions", prefix="/_matrix/client"
            )
            self.assertIn("v1.11", versions["versions"])
        finally:
            await port.stopListening()
            await hs.close()
