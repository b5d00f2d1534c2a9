"""The launcher: ``bin/roomstore-compact`` builds the spark-submit line and execs it.

Runs in the operator's process, before Spark: it validates the options (so
``--help`` and mistakes stop here), picks the JDBC driver jar for the
database URL, zips the ``roomstore`` package (plus ``attrs``) for
``--py-files`` so executors need no installation, and execs
``spark-submit ... roomstore/compaction/spark_job.py <job options>``.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import attr
import attrs
import pyspark

from roomstore.compaction.job.jdbc import jdbc_driver
from roomstore.compaction.job.options import APP_NAME, submit_parser, unreachable_master
from roomstore.storage.engines import engine_from_url
from roomstore.storage.errors import DatabaseConfigError, DatabaseUnavailableError

#: The file spark-submit runs (a thin entry into :mod:`roomstore.compaction.job.driver`).
ENTRY_FILE = Path(__file__).resolve().parent.parent / "spark_job.py"
#: The ``roomstore`` package directory, zipped for the executors.
PACKAGE_DIR = Path(__file__).resolve().parent.parent.parent

_LOG4J2 = """\
# Written by bin/roomstore-compact: Spark at WARN, our job logs its own progress.
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.nativeloader.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativeloader.level = error
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
"""


def _cache_dir() -> Path:
    base = os.environ.get("ROOMSTORE_COMPACT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "roomstore-compact"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_py_files_zip(cache: Path | None = None) -> Path:
    """Zip the ``roomstore`` package (plus the pure-Python ``attrs``) for ``--py-files``.

    Executors then need only Python with pyspark's own dependencies (pyarrow,
    numpy, pandas). Named by a hash of the contents, so an unchanged checkout
    reuses the zip.
    """
    roots = [
        (PACKAGE_DIR, "roomstore"),
        (Path(attr.__file__).resolve().parent, "attr"),
        (Path(attrs.__file__).resolve().parent, "attrs"),
    ]
    files: list[tuple[str, Path]] = []
    for root, name in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files.append((f"{name}/{path.relative_to(root).as_posix()}", path))
    digest = hashlib.sha256()
    for arcname, path in files:
        digest.update(arcname.encode())
        digest.update(path.read_bytes())
    target = (cache or _cache_dir()) / f"roomstore-{digest.hexdigest()[:16]}.zip"
    if not target.exists():
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for arcname, path in files:
                info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
        os.replace(tmp, target)
    return target


#: The driver JVM's default JIT: the quick compiler only (overridden by a
#: ``--driver-java-options`` naming a tiered-compilation flag).
DRIVER_JIT_OPTION = "-XX:TieredStopAtLevel=1"
#: The executors' default JIT (``spark.executor.extraJavaOptions``, unless a
#: ``--conf`` sets that): the same.
EXECUTOR_JIT_OPTION = DRIVER_JIT_OPTION


def build_submit_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The ``spark-submit`` command line and environment for ``argv`` (wrapper options + job options)."""
    parser = submit_parser()
    opts, _ = parser.parse_known_args(argv)
    # Strip the wrapper's own options; everything else goes to the job as given.
    job_args = _strip_submit_options(list(argv))
    cache = _cache_dir()
    log4j = cache / "log4j2.properties"
    if not log4j.exists() or log4j.read_text() != _LOG4J2:
        log4j.write_text(_LOG4J2)
    engine = engine_from_url(opts.db or opts.synapse, create=False)
    driver = jdbc_driver(engine)
    jars = list(opts.jdbc_jar) or [driver.jar()]
    for jar in jars:
        if not os.path.exists(jar):
            raise SystemExit(
                f"roomstore-compact: JDBC driver jar {jar} not found (Debian: apt-get install"
                f" {driver.jar_package}; or pass --jdbc-jar)"
            )
    zip_path = build_py_files_zip(cache)
    spark_home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    submit = opts.spark_submit or os.path.join(spark_home, "bin", "spark-submit")
    cmd = [submit, "--master", opts.master, "--name", APP_NAME]
    cmd += ["--jars", ",".join(jars), "--driver-class-path", os.pathsep.join(jars)]
    cmd += ["--py-files", str(zip_path)]
    java_opts = [f"-Dlog4j2.configurationFile=file:{log4j}"] + list(opts.driver_java_options)
    if not any("TieredStopAtLevel" in o or "TieredCompilation" in o for o in opts.driver_java_options):
        # The driver JVM mostly waits: with the optimising compiler it spent
        # 10 of its 24 CPU seconds compiling (a 1M-row room, a loaded
        # 2-core machine); the quick compiler alone costs 2.
        java_opts.insert(1, DRIVER_JIT_OPTION)
    cmd += ["--driver-java-options", " ".join(java_opts)]
    cmd += ["--conf", "spark.ui.showConsoleProgress=false"]
    for flag, value in (
        ("--driver-memory", opts.driver_memory),
        ("--executor-memory", opts.executor_memory),
        ("--executor-cores", opts.executor_cores),
        ("--num-executors", opts.num_executors),
    ):
        if value:
            cmd += [flag, value]
    # The Pythons in the line itself, not in the environment: the line runs as
    # printed from a shell with no virtualenv active. The driver is this
    # Python (it has roomstore, psycopg2, prometheus_client); executors too
    # unless --conf spark.pyspark.python or PYSPARK_PYTHON names another
    # (a cluster's workers: docs/compaction.md).
    given = {conf.split("=", 1)[0].strip() for conf in opts.conf}
    if "spark.pyspark.driver.python" not in given:
        cmd += ["--conf", f"spark.pyspark.driver.python={sys.executable}"]
    if "spark.pyspark.python" not in given:
        cmd += ["--conf", f"spark.pyspark.python={os.environ.get('PYSPARK_PYTHON') or sys.executable}"]
    if "spark.executor.extraJavaOptions" not in given:
        # Executors mostly move rows from JDBC to Python: the optimising
        # compiler's work there (9-14 CPU s per run on a 2-core machine) took
        # longer than it saved; the quick compiler alone also starts them
        # sooner (5 s instead of 14 s from the application's start to the
        # executor's registration, a loaded 2-core machine).
        cmd += ["--conf", f"spark.executor.extraJavaOptions={EXECUTOR_JIT_OPTION}"]
    for conf in opts.conf:
        cmd += ["--conf", conf]
    cmd.append(str(ENTRY_FILE))
    cmd += job_args
    env = dict(os.environ)
    for name, value in line_environment(opts.master, spark_home).items():
        env[name] = value
    return cmd, env


def line_environment(master: str, spark_home: str) -> dict[str, str]:
    """The variables the printed line sets itself (``env NAME=VALUE spark-submit ...``)."""
    names = {"SPARK_HOME": os.environ.get("SPARK_HOME") or spark_home}
    if master.startswith("local"):
        # The host name may resolve to an address Spark cannot bind (and Spark
        # warns about it): loopback, unless the operator chose an address.
        names["SPARK_LOCAL_IP"] = os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
    return names


def printable_command(cmd: Sequence[str], env: dict[str, str]) -> str:
    """The line ``--print-command`` prints: ``env`` with the variables of
    ``line_environment`` (their values from ``env``), then spark-submit and
    its arguments, shell-quoted."""
    master = cmd[list(cmd).index("--master") + 1]
    names = line_environment(master, env.get("SPARK_HOME", ""))
    prefix = ["env"] + [f"{name}={env.get(name, value)}" for name, value in names.items()]
    return " ".join(shlex.quote(part) for part in [*prefix, *cmd])


_SUBMIT_FLAGS_WITH_VALUE = {
    "--master",
    "--conf",
    "--driver-memory",
    "--executor-memory",
    "--executor-cores",
    "--num-executors",
    "--deploy-mode",
    "--jdbc-jar",
    "--spark-submit",
    "--driver-java-options",
}
_SUBMIT_FLAGS = {"--print-command"}


def _strip_submit_options(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _SUBMIT_FLAGS_WITH_VALUE:
            i += 1 if "=" in arg else 2
            continue
        if name in _SUBMIT_FLAGS:
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def submit_main(argv: Sequence[str] | None = None) -> int:
    """``bin/roomstore-compact``: validate the options, then exec ``spark-submit``.

    exec (not a child process): the wrapper's process becomes spark-submit, so
    signals and the exit status are spark-submit's own.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = submit_parser()
    opts = parser.parse_args(argv)  # --help and bad options stop here, before Spark starts
    try:
        # A mistyped SQLite path is not a new database; an unreachable server
        # or a file that is not a database stop here too, before Spark starts.
        engine = engine_from_url(opts.db or opts.synapse, create=False)
        if opts.synapse and engine.name != "postgres":
            raise DatabaseConfigError("--synapse takes a PostgreSQL URL (postgresql://user@host:port/synapse)")
        engine.check_usable()
    except (DatabaseConfigError, DatabaseUnavailableError) as exc:
        sys.stderr.write(f"roomstore-compact: {exc}\n")
        return 2
    if not opts.print_command:
        reason = unreachable_master(opts.master)
        if reason is not None:
            sys.stderr.write(f"roomstore-compact: {reason}\n")
            return 2
    cmd, env = build_submit_command(argv)
    if opts.print_command:
        print(printable_command(cmd, env))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
