"""Where reads stop, and whether a client's token may be read from.

``ReadPositions`` turns the events stream generator's per-writer positions
into stream tokens ("now" for every read), maps writer instance names to the
ids tokens carry (the ``instances`` table, whose SQL lives here), and waits,
boundedly, for a token ahead of this process (a worker behind its writer)
before refusing it.

Who calls it: ``TimelineReader`` (every client read) and ``RoomStore``
(registering its instance).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer

from roomstore.events.tokens import InvalidToken, StreamToken, TopologicalToken
from roomstore.storage.database import Database, Transaction

__all__ = ["ReadPositions", "instances_txn", "register_instance_txn"]


def register_instance_txn(txn: Transaction, instance_name: str) -> None:
    """Give a writer instance its id (once; ids never change)."""
    txn.execute("INSERT INTO instances (instance_name) VALUES (?) ON CONFLICT DO NOTHING", (instance_name,))


def instances_txn(txn: Transaction) -> list[tuple[int, str]]:
    """Every ``(instance_id, instance_name)``."""
    return txn.execute("SELECT instance_id, instance_name FROM instances").fetchall()


class ReadPositions:
    """Stream tokens of "now" and the check of a client's token.

    Collaborators: the database (the instances map), the events stream's ID
    generator, this process's instance name, how long to wait for a token
    ahead (``StoreConfig.token_wait_ms``) and the clock that times the wait.
    """

    def __init__(self, db: Database, events_stream: Any, instance_name: str, token_wait_ms: int, clock: Any):
        self.db = db
        self.events_stream = events_stream
        self.instance_name = instance_name
        self.token_wait_ms = token_wait_ms
        self.clock = clock
        # instance_name <-> instance_id of the `instances` table, as stream
        # tokens carry ids. Rows are never changed or deleted, so the map
        # only grows; it is reloaded when a name or id is missing.
        self._instance_ids: dict[str, int] = {}
        self._instance_names: dict[int, str] = {}

    async def ensure_instances(self, token: StreamToken | None = None) -> None:
        """Load the instances map when a writer ahead of the linear position,
        or an instance named by ``token``, is not in it (no query otherwise).

        Raises ``InvalidToken`` for an instance id no instance has.
        """
        positions = self.events_stream.get_positions()
        linear = min(positions.values())
        wanted_names = [n for n, p in positions.items() if p > linear and n not in self._instance_ids]
        wanted_ids = [] if token is None else [i for i, _ in token.instance_positions if i not in self._instance_names]
        if wanted_names or wanted_ids:
            rows = await self.db.run_interaction("timeline_instances", instances_txn)
            for instance_id, name in rows:
                self._instance_ids[name] = instance_id
                self._instance_names[instance_id] = name
        unknown = [] if token is None else [i for i, _ in token.instance_positions if i not in self._instance_names]
        if unknown and token is not None:
            raise InvalidToken(f"token {token.to_string()!r} names unknown writer instance id(s) {unknown}")

    def now(self) -> StreamToken:
        """The position reads stop at: every writer's completed position.

        A writer without an instance id (it never registered, which a writer
        ahead of the others cannot be after ``ensure_instances``) is
        represented at the minimum: the token then promises no more of it.
        """
        positions = self.events_stream.get_positions()
        linear = min(positions.values())
        ahead = {
            self._instance_ids[name]: pos
            for name, pos in positions.items()
            if pos > linear and name in self._instance_ids
        }
        return StreamToken.create(linear, ahead)

    def per_writer(self, token: StreamToken) -> tuple[int, dict[str, int]]:
        """(default position, instance name -> position) of a token."""
        return token.stream, {self._instance_names[i]: p for i, p in token.instance_positions}

    async def reach(self, token: StreamToken | TopologicalToken) -> None:
        """Return once this process's positions reach ``token``'s.

        A token ahead of them was not handed out by this stream, unless this
        process is a worker (or one writer of several) still behind another
        writer: then wait for the writers' positions, at most
        ``StoreConfig.token_wait_ms``. ``InvalidToken`` if it stays ahead: a
        client syncing or paginating from it would miss every event up to it.
        A topological token's stream part is an event's position: some
        writer reached it.
        """
        if isinstance(token, TopologicalToken):

            def reached(now: StreamToken) -> bool:
                return token.stream <= now.get_max_stream_pos()
        else:

            def reached(now: StreamToken) -> bool:
                return token.is_before_or_eq(now)

        now = self.now()
        if reached(now):
            return
        generator = self.events_stream
        if generator.writers != (self.instance_name,):
            if isinstance(token, TopologicalToken):
                targets = [(token.stream, name) for name in generator.writers]
            else:
                default, per_writer = self.per_writer(token)
                targets = [(per_writer.get(name, default), name) for name in generator.writers]
            waits = [generator.wait_for_position(position, name) for position, name in targets]
            waiting: defer.Deferred[Any]
            if isinstance(token, TopologicalToken):
                waiting = defer.DeferredList(waits, fireOnOneCallback=True, consumeErrors=True)
            else:
                waiting = defer.DeferredList(waits, consumeErrors=True)
            waiting.addTimeout(self.token_wait_ms / 1000, self.clock)
            try:
                await waiting
            except defer.TimeoutError:
                pass
            finally:
                for d in waits:
                    if not d.called:
                        d.cancel()
            now = self.now()
            if reached(now):
                return
        raise InvalidToken(
            f"token {token.to_string()!r} is ahead of the events stream (now at {now.to_string()!r}):"
            " it was not issued here; sync without a token (an initial sync) for a current one"
        )

    @staticmethod
    def parse_stream_token(token: str) -> StreamToken:
        """An ``s``/``m`` token; ``InvalidToken`` for anything else."""
        if not isinstance(token, str) or token[:1] not in ("s", "m"):
            raise InvalidToken(f"{token!r} is not a stream token ('s<n>' or 'm<n>~<instance>.<pos>...')")
        return StreamToken.parse(token)
