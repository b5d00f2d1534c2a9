"""The twistd plugin: the options of ``roomstore serve``, and installed by a
plain (non-editable) ``pip install`` so that ``twistd roomstore`` works from
any directory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.cli import build_parser
from roomstore.twistd_plugin import Options, serviceMaker
from tests.db import on_both_engines
from tests.test_install import clean_env, installed_venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_options() -> set[str]:
    """The long options of ``roomstore serve``, less -v (twistd has its own logging) and --help."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = {o for action in sub.choices["serve"]._actions for o in action.option_strings if o.startswith("--")}
    return names - {"--help", "--verbose"}


def plugin_options() -> set[str]:
    return {"--" + p[0] for p in Options.optParameters} | {"--stream-writers"}


class PluginOptionsTests(unittest.TestCase):
    def test_every_serve_option(self):
        self.assertEqual(plugin_options(), serve_options())

    def test_max_line_length_reaches_the_service(self):
        options = Options()
        options.parseOptions(
            ["--db", "sqlite:///nowhere.db", "--max-line-length", "100", "--stream-writers", "events=master"]
        )
        service = serviceMaker.makeService(options)
        self.assertEqual(service.config.max_line_length, 100)
        self.assertEqual(dict(service.store_config.stream_writers), {"events": ["master"]})
        from twisted.python.usage import UsageError

        with self.assertRaises(UsageError):
            Options().parseOptions(["--max-line-length", "0"])


def twistd(venv: str, *args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(venv, "bin", "twistd"), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=cwd,
        timeout=120,
    )


@on_both_engines
class InstalledPluginTests:
    """From a venv made by a plain ``pip install`` of a copy of the checkout
    (tests/test_install.py), run from an empty directory."""

    async def test_twistd_roomstore_from_a_non_editable_install(self):
        venv = await threads.deferToThread(installed_venv)
        plugin = os.path.join(
            venv,
            "lib",
            f"python{sys.version_info[0]}.{sys.version_info[1]}",
            "site-packages",
            "twisted",
            "plugins",
            "roomstore_plugin.py",
        )
        self.assertTrue(os.path.isfile(plugin), plugin)  # installed, not found through the checkout
        cwd = tempfile.mkdtemp(prefix="roomstore-twistd-")
        self.addCleanup(shutil.rmtree, cwd, True)

        listed = await threads.deferToThread(twistd, venv, "--help", cwd=cwd)
        self.assertEqual(listed.returncode, 0, listed.stderr)
        self.assertRegex(listed.stdout, r"\n\s+roomstore\s+roomstore replication server")

        helped = await threads.deferToThread(twistd, venv, "-n", "roomstore", "--help", cwd=cwd)
        self.assertEqual(helped.returncode, 0, helped.stderr)
        self.assertEqual(set(re.findall(r"(--[a-z-]+)=", helped.stdout)), serve_options())

        # It runs: the store opened, the port listening, stopped by SIGTERM.
        url = self.new_database_url()
        await threads.deferToThread(self.run_until_listening, venv, cwd, url)

    def run_until_listening(self, venv: str, cwd: str, url: str) -> None:
        proc = subprocess.Popen(
            [
                os.path.join(venv, "bin", "twistd"),
                "-n",
                "--pidfile=",
                "roomstore",
                "--db",
                url,
                "--replication-port",
                "0",
                "--max-line-length",
                "4096",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
            cwd=cwd,
        )
        try:
            deadline = time.monotonic() + 60
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if "listening on 127.0.0.1:" in line:
                    break
                if time.monotonic() > deadline:
                    break
            self.assertIn("listening on 127.0.0.1:", "".join(seen))
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            rest = proc.stdout.read()
            # twistd ends by re-raising the signal it stopped for.
            self.assertIn(code, (0, -signal.SIGTERM), "".join(seen) + rest)
            self.assertIn("Server Shut Down.", rest)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
