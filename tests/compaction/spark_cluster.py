"""A throwaway Spark standalone cluster on loopback, for tests and benchmarks.

A master and N workers, each a separate JVM started with the pyspark
package's own launcher (``bin/spark-class org.apache.spark.deploy.master.Master``
and ``...deploy.worker.Worker``), bound to 127.0.0.1 on free ports, each
worker with its own work directory. Executors run a Python of their own
(:func:`executor_python`): a virtualenv that sees pyspark and its
dependencies but *not* roomstore, so the job only works if everything the
executors need travels with the application (``--py-files``, ``--jars``).

    with SparkCluster(workers=2, cores=1, memory="1g") as cluster:
        run(["bin/roomstore-compact", "--master", cluster.url, *cluster.submit_options(), ...])
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spark_home() -> str:
    import pyspark

    return os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)


def executor_python(directory: str) -> str:
    """A Python for executors that imports pyspark, pyarrow, numpy and pandas
    from this virtualenv but cannot import roomstore (the editable install's
    hook is a ``.pth`` file of this site-packages, which a path added by
    another ``.pth`` does not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", directory], check=True)
    site = sysconfig.get_paths()["purelib"]
    target = Path(directory) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (target / "executor-deps.pth").write_text(site + "\n")
    python = str(Path(directory) / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [python, "-c", "import pyspark, pyarrow, roomstore"], cwd=directory, env=env, capture_output=True, text=True
    )
    if "No module named 'roomstore'" not in probe.stderr:
        raise RuntimeError(f"the executor Python should see pyspark but not roomstore: {probe.stderr!r}")
    return python


class SparkCluster:
    """Start on ``__enter__`` (or :meth:`start`), stop (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g", start_timeout: float = 120) -> None:
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.start_timeout = start_timeout
        self.directory = tempfile.mkdtemp(prefix="roomstore-spark-cluster-")
        self.port = free_port()
        self.ui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.python: str | None = None

    def _env(self) -> dict:
        env = dict(os.environ)
        env.update(
            SPARK_HOME=spark_home(),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOG_DIR=os.path.join(self.directory, "logs"),
            SPARK_PID_DIR=self.directory,
        )
        # The daemons must not inherit a PYTHONPATH that would let executors
        # import roomstore from this checkout.
        env.pop("PYTHONPATH", None)
        return env

    def _launch(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.directory, f"{name}.log"), "w")
        proc = subprocess.Popen(
            [os.path.join(spark_home(), "bin", "spark-class"), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(),
            cwd=self.directory,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as response:
            return json.load(response)

    def start(self) -> SparkCluster:
        """Start the daemons and wait until every worker has registered; on
        any failure the daemons started so far are stopped."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> SparkCluster:
        self.python = executor_python(os.path.join(self.directory, "executor-venv"))
        self._launch(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            ],
        )
        for n in range(self.workers):
            work = os.path.join(self.directory, f"worker{n}")
            os.makedirs(work)
            self._launch(
                f"worker{n}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--work-dir",
                    work,
                    "--webui-port",
                    str(free_port()),
                    self.url,
                ],
            )
        deadline = time.monotonic() + self.start_timeout
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"a Spark daemon exited at start-up (exit {proc.returncode}); logs in {self.directory}"
                    )
            try:
                if self.status().get("aliveworkers") == self.workers:
                    return self
            except (OSError, ValueError):  # not listening yet, or answering before its JSON is ready
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Spark cluster did not start in {self.start_timeout:.0f}s; logs in {self.directory}"
                )
            time.sleep(0.5)

    def submit_options(self, executor_memory: str | None = None) -> list[str]:
        """``bin/roomstore-compact`` options to run on this cluster."""
        assert self.python is not None, "start the cluster first"
        return [
            "--executor-memory",
            executor_memory or self.memory,
            "--conf",
            f"spark.pyspark.python={self.python}",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
        ]

    def daemon_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def executor_logs(self) -> list[Path]:
        """The ``stderr`` of every executor the workers ran."""
        return sorted(Path(self.directory).glob("worker*/app-*/*/stderr"))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> SparkCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
