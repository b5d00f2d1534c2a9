"""Real clients against ``roomstore homeserver`` started as a process, on
both engines (issue 41 item 4): matrix-nio drives the scenario in
``nio_scenario.py``. ``bin/setup`` installs matrix-nio (the test extra); the
test fails, never skips, without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.internet import threads

from tests.db import on_both_engines
from tests.homeserver.test_command import start, stop

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nio_scenario.py")
STEPS = ["createRoom", "invite seen in initial sync", "100 messages sent; a retried txnId returned the same event",
         "redaction", "limited sync and back-pagination", "incremental sync woken by a send", "/state",
         "leave, and what the leaver sees"]


@on_both_engines
class NioTests:
    async def test_nio_scenario(self):
        proc, serving = await threads.deferToThread(start, self.new_database_url())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        base = f"http://127.0.0.1:{serving['port']}"
        client = await threads.deferToThread(
            subprocess.run, [sys.executable, SCRIPT, base, serving["server_name"]], capture_output=True, text=True,
            timeout=300,
        )
        lines = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
        self.assertEqual(client.returncode, 0, f"{lines[-1:]} {client.stderr[-3000:]}")
        self.assertEqual([line["step"] for line in lines], STEPS)
        self.assertNotIn("Error validating", client.stderr)  # nio parsed every event this server sent
        self.assertEqual(next(l for l in lines if l["step"] == "limited sync and back-pagination")["messages"], 100)
        code, err = await threads.deferToThread(stop, proc)
        self.assertEqual(code, 0, err)
