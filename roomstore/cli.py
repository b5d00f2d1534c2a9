"""``roomstore``: the command line for operators and the main job.

Every command takes ``--db URL`` (default: an embedded SQLite file,
``sqlite:///var/roomstore.db``) and prints JSON, one object a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from twisted.internet import defer, task

DEFAULT_DB = "sqlite:///var/roomstore.db"


def emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


async def cmd_init(reactor, args) -> int:
    """Create or upgrade the schema; print the version and stream positions."""
    from roomstore.storage import open_database
    from roomstore.streams.builtin import open_builtin_generators

    db = await open_database(args.db, reactor)
    try:
        version = await db.run_interaction("schema_version", lambda t: t.select_one_value("SELECT version FROM schema_version"))
        generators = await open_builtin_generators(db, args.instance)
        emit({"db": db.engine.describe(), "schema_version": version})
        for name, gen in generators.items():
            emit({"stream": name, "positions": gen.get_positions(), "current": gen.get_current_token()})
    finally:
        await db.close()
    return 0


async def cmd_demo(reactor, args) -> int:
    """The main job on the embedded default: initialise a store and report on it."""
    return await cmd_init(reactor, args)


COMMANDS: dict[str, Callable] = {"init": cmd_init, "demo": cmd_demo}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roomstore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--db", default=DEFAULT_DB, help=f"database URL (default {DEFAULT_DB})")
        p.add_argument("--instance", default="master", help="this process's instance name")
        p.add_argument("-v", "--verbose", action="store_true", help="log at info level to stderr")
        return p

    add("init", "create or upgrade the schema; print schema version and stream positions")
    add("demo", "the main job: initialise a store and show what it holds")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command]
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    level = LogLevel.info if args.verbose else LogLevel.warn
    observer = FilteringLogObserver(
        textFileLogObserver(sys.stderr), [LogLevelFilterPredicate(defaultLogLevel=level)]
    )
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)

    async def run_command(reactor):
        code = await handler(reactor, args) or 0
        if code:
            raise SystemExit(code)  # react() exits with a SystemExit's code

    task.react(lambda reactor: defer.ensureDeferred(run_command(reactor)), [])


if __name__ == "__main__":
    main()
