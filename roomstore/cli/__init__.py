"""``roomstore``: the command line for operators and the main job.

Every command takes ``--db URL`` (default: an embedded SQLite file,
``sqlite:///var/roomstore.db``) and prints JSON, one object a line; progress
and logs go to stderr.

This module assembles the command line: each command group's module
(``schema``, ``imports``, ``synapse``, ``homeserver``, ``reads``, ``purge``,
``demo``, ``replication``) adds its commands' options, :data:`COMMANDS`
names the function that runs each, and :func:`main` runs it, turning the
errors a person can fix into one line and an exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from twisted.internet import defer

from roomstore.cli import demo, homeserver, imports, purge, reads, replication, schema, synapse
from roomstore.cli.common import CliError, add_common_options
from roomstore.processes import react_and_leave

#: The command groups, in the order ``roomstore --help`` lists their commands.
GROUPS = (schema, imports, synapse, homeserver, reads, purge, demo, replication)

COMMANDS: dict[str, Callable] = {
    "init": schema.cmd_init,
    "import": imports.cmd_import,
    "import-synapse": synapse.cmd_import_synapse,
    "verify-synapse": synapse.cmd_verify_synapse,
    "state": reads.cmd_state,
    "messages": reads.cmd_messages,
    "sync": reads.cmd_sync,
    "recent": reads.cmd_recent,
    "stats": reads.cmd_stats,
    "purge-history": purge.cmd_purge_history,
    "purge-room": purge.cmd_purge_room,
    "demo": demo.cmd_demo,
    "generate-sample": demo.cmd_generate_sample,
    "serve": replication.cmd_serve,
    "follow": replication.cmd_follow,
    "homeserver": homeserver.cmd_homeserver,
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command: each group adds its own through ``add(name, help)``,
    which gives each command the options every command takes."""
    parser = argparse.ArgumentParser(prog="roomstore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        add_common_options(p)
        return p

    for group in GROUPS:
        group.add_parsers(add)
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
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [LogLevelFilterPredicate(defaultLogLevel=level)])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)

    async def run_command(reactor):
        try:
            code = await handler(reactor, args) or 0
        except CliError as exc:
            sys.stderr.write(f"roomstore {args.command}: {exc}\n")
            code = 2
        except BrokenPipeError:
            # The reader left (``roomstore stats | head``): leave quietly, as
            # Unix tools do (128 + SIGPIPE), with nothing left to flush at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 141
        except Exception as exc:
            # Errors the store raises for bad input carry a clear message.
            from roomstore.events.tokens import InvalidToken
            from roomstore.storage import DatabaseConfigError, DatabaseUnavailableError, SchemaError, StorageFullError

            if isinstance(exc, (DatabaseUnavailableError, StorageFullError)):
                sys.stderr.write(f"roomstore {args.command}: {exc}\n")
                code = 2
            elif isinstance(exc, (InvalidToken, DatabaseConfigError, SchemaError, ValueError)):
                sys.stderr.write(f"roomstore {args.command}: {type(exc).__name__}: {exc}\n")
                code = 2
            elif args.verbose:
                raise
            else:
                # Anything else still gets one line; -v shows the traceback.
                reason = " ".join(str(exc).split()) or "no message"
                sys.stderr.write(
                    f"roomstore {args.command}: {type(exc).__name__}: {reason} (run again with -v for the traceback)\n"
                )
                code = 1
        if code:
            raise SystemExit(code)  # react() exits with a SystemExit's code

    # Once the command is done and its store closed, leave without freeing
    # its caches object by object (``roomstore.processes``).
    react_and_leave(lambda reactor: defer.ensureDeferred(run_command(reactor)))
