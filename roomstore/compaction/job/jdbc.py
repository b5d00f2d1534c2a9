"""What Spark needs to read a database over JDBC, per engine: the driver
class, where its jar is, and the JDBC URL with its connection properties.

Only the compaction job reads over JDBC, so this lives with the job rather
than on :class:`~roomstore.storage.engines.Engine`; keyed by the engine's
``name``.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

import attrs


@attrs.frozen
class JdbcDriver:
    """A JDBC driver: its class, the environment variable naming its jar, the
    jar's default path, and the Debian package with it."""

    driver: str
    jar_env: str
    jar_default: str
    jar_package: str

    def jar(self) -> str:
        """The jar's path: the environment variable's, else the default."""
        return os.environ.get(self.jar_env, self.jar_default)


DRIVERS: dict[str, JdbcDriver] = {
    "sqlite": JdbcDriver(
        "org.sqlite.JDBC", "ROOMSTORE_SQLITE_JDBC_JAR", "/usr/share/java/sqlite-jdbc.jar", "libxerial-sqlite-jdbc-java"
    ),
    "postgres": JdbcDriver(
        "org.postgresql.Driver",
        "ROOMSTORE_POSTGRES_JDBC_JAR",
        "/usr/share/java/postgresql.jar",
        "libpostgresql-jdbc-java",
    ),
}


def jdbc_driver(engine: Any) -> JdbcDriver:
    return DRIVERS[engine.name]


def jdbc_url(engine: Any) -> tuple[str, dict[str, str]]:
    """The JDBC URL of ``engine``'s database and its connection properties."""
    if engine.name == "sqlite":
        return f"jdbc:sqlite:{os.path.abspath(engine.path)}", {}
    parsed = urllib.parse.urlsplit(engine.dsn)
    props: dict[str, str] = {}
    if parsed.username:
        props["user"] = urllib.parse.unquote(parsed.username)
    if parsed.password:
        props["password"] = urllib.parse.unquote(parsed.password)
    props.update(urllib.parse.parse_qsl(parsed.query))
    # JIT off, as on the job's own connections (PostgresEngine.connect), unless
    # the URL's options set it: each partition's sorted read costs above
    # jit_above_cost, and compiling its expressions took longer than running
    # them.
    props["options"] = " ".join(filter(None, ["-c jit=off", props.get("options")]))
    host = parsed.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    return f"jdbc:postgresql://{host}:{parsed.port or 5432}{parsed.path}", props
