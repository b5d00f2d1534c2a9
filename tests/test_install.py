"""A real, non-editable ``pip install .`` into a fresh virtualenv, then ``roomstore init``.

The schema ships as package data: the installed command creates a database
with no ``ROOMSTORE_SCHEMA_DIR`` and no checkout on its path. The source tree
(the files git lists) is copied first, so the build leaves nothing in the checkout.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from twisted.internet import threads

from roomstore.storage import SCHEMA_VERSION
from tests.db import on_both_engines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_venv_lock = threading.Lock()
_venv: dict[str, str] = {}


def installed_venv() -> str:
    """A fresh venv with roomstore installed from a copy of the source (once per process)."""
    with _venv_lock:
        if "path" not in _venv:
            base = tempfile.mkdtemp(prefix="roomstore-install-")
            atexit.register(shutil.rmtree, base, True)
            source = os.path.join(base, "src")
            # The project's files as git sees them (tracked, or new and not ignored).
            listed = (
                subprocess.run(
                    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                    cwd=ROOT,
                    capture_output=True,
                    check=True,
                )
                .stdout.decode()
                .split("\0")
            )
            for name in filter(None, listed):
                if os.path.isfile(os.path.join(ROOT, name)):
                    os.makedirs(os.path.dirname(os.path.join(source, name)), exist_ok=True)
                    shutil.copy2(os.path.join(ROOT, name), os.path.join(source, name))
            venv = os.path.join(base, "venv")
            subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120, env=clean_env())
            proc = subprocess.run(
                [os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check", source],
                capture_output=True,
                text=True,
                timeout=600,
                env=clean_env(),
            )
            if proc.returncode:
                raise AssertionError(f"pip install failed:\n{proc.stdout}\n{proc.stderr}")
            shutil.rmtree(source)
            _venv["path"] = venv
        return _venv["path"]


def clean_env() -> dict[str, str]:
    """The environment without anything that points into the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("ROOMSTORE_SCHEMA_DIR", "PYTHONPATH", "VIRTUAL_ENV")}


def run_installed(venv: str, *args: str) -> subprocess.CompletedProcess:
    env = clean_env()
    # Run from an empty directory: nothing of the checkout is reachable.
    cwd = tempfile.mkdtemp(prefix="roomstore-cwd-")
    try:
        return subprocess.run(
            [os.path.join(venv, "bin", "roomstore"), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=120,
        )
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


@on_both_engines
class InstalledPackageTests:
    async def test_init_from_a_non_editable_install(self):
        venv = await threads.deferToThread(installed_venv)
        where = subprocess.run(
            [os.path.join(venv, "bin", "python"), "-c", "import roomstore; print(roomstore.__file__)"],
            capture_output=True,
            text=True,
            cwd=venv,
            env=clean_env(),
        )
        self.assertTrue(where.stdout.strip().startswith(venv), where.stdout + where.stderr)
        url = self.new_database_url()
        proc = await threads.deferToThread(run_installed, venv, "init", "--db", url)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        first = json.loads(proc.stdout.splitlines()[0])
        self.assertEqual(first["schema_version"], SCHEMA_VERSION)
