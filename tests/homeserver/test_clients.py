"""Real clients against ``roomstore homeserver`` started as a process, on
both engines (issue 41 item 4): matrix-nio drives the scenario in
``nio_scenario.py``, matrix-js-sdk the one in ``js/scenario.mjs`` (under
Node). ``bin/setup`` installs matrix-nio (the test extra) and the npm modules
(``npm ci`` in ``js/``); each test fails, never skips, without them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from twisted.internet import threads

from tests.db import on_both_engines
from tests.homeserver.test_command import start, stop

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "nio_scenario.py")
JS_DIR = os.path.join(HERE, "js")
JS_STEPS = [
    "createRoom",
    "invite seen in initial sync",
    "join",
    "100 messages sent; a retried txnId returned the same event",
    "redaction",
    "limited sync and back-pagination",
    "incremental sync woken by a send",
    "/state",
    "leave, and what the leaver sees",
    "every request the SDK made succeeded",
]
STEPS = [
    "createRoom",
    "invite seen in initial sync",
    "100 messages sent; a retried txnId returned the same event",
    "redaction",
    "limited sync and back-pagination",
    "incremental sync woken by a send",
    "/state",
    "leave, and what the leaver sees",
]


@on_both_engines
class NioTests:
    async def test_nio_scenario(self):
        proc, serving = await threads.deferToThread(start, self.new_database_url())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        base = f"http://127.0.0.1:{serving['port']}"
        client = await threads.deferToThread(
            subprocess.run,
            [sys.executable, SCRIPT, base, serving["server_name"]],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
        self.assertEqual(client.returncode, 0, f"{lines[-1:]} {client.stderr[-3000:]}")
        self.assertEqual([line["step"] for line in lines], STEPS)
        self.assertNotIn("Error validating", client.stderr)  # nio parsed every event this server sent
        self.assertEqual(
            next(line for line in lines if line["step"] == "limited sync and back-pagination")["messages"], 100
        )
        code, err = await threads.deferToThread(stop, proc)
        self.assertEqual(code, 0, err)


def node_command() -> list[str]:
    """``node scenario.mjs``; an AssertionError (never a skip) naming what
    is missing when node or the npm modules are not installed."""
    node = shutil.which("node")
    if node is None:
        raise AssertionError("no node on PATH: run bin/setup (installs nodejs and npm)")
    if not os.path.isdir(os.path.join(JS_DIR, "node_modules", "matrix-js-sdk")):
        raise AssertionError(f"matrix-js-sdk is not installed in {JS_DIR}: run bin/setup (npm ci there)")
    return [node, os.path.join(JS_DIR, "scenario.mjs")]


@on_both_engines
class JsSdkTests:
    async def test_js_sdk_scenario(self):
        command = node_command()
        proc, serving = await threads.deferToThread(start, self.new_database_url())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        base = f"http://127.0.0.1:{serving['port']}"
        client = await threads.deferToThread(
            subprocess.run,
            [*command, base, serving["server_name"]],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=JS_DIR,
        )
        lines = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
        self.assertEqual(client.returncode, 0, f"{lines[-1:]} {client.stderr[-3000:]}")
        self.assertEqual([line["step"] for line in lines], JS_STEPS)
        facts = {line["step"]: line for line in lines}
        self.assertEqual(facts["limited sync and back-pagination"]["messages"], 100)
        start_up = facts["invite seen in initial sync"]["start_up"]
        for wanted in ("GET /_matrix/client/v3/pushrules/ 200", "GET /_matrix/client/v3/capabilities 200"):
            self.assertIn(wanted, start_up)
        code, err = await threads.deferToThread(stop, proc)
        self.assertEqual(code, 0, err)
