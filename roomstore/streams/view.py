"""``GeneratorView``: a stream's positions, as code outside the store sees them.

``RoomStore.stream(name)`` hands one out for each built-in stream. It reads
the stream's writers and positions, waits for a position, reads the positions
last persisted, and ``advance``\\ s a position learnt from another process
(replication); it cannot reserve IDs or close the generator, which stay the
store's own.
"""

from __future__ import annotations

import attrs
from twisted.internet import defer

from roomstore.streams.id_generators import StreamIdGenerator

__all__ = ["GeneratorView"]


@attrs.frozen
class GeneratorView:
    """The read-and-follow face of one ``StreamIdGenerator`` (same method names)."""

    _generator: StreamIdGenerator

    @property
    def name(self) -> str:
        return self._generator.stream_name

    @property
    def writers(self) -> tuple[str, ...]:
        """Every instance that writes the stream."""
        return self._generator.writers

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the stream."""
        return self._generator.is_writer

    def get_current_token(self) -> int:
        """The linear position: every fact at or below it has completed."""
        return self._generator.get_current_token()

    def get_current_token_for_writer(self, instance_name: str) -> int:
        """The position of one writer (``KeyError`` for an instance that is not one)."""
        return self._generator.get_current_token_for_writer(instance_name)

    def get_positions(self) -> dict[str, int]:
        """writer -> position."""
        return self._generator.get_positions()

    def wait_for_position(self, token: int, instance_name: str | None = None) -> defer.Deferred[int]:
        """Fires once the stream (or, with ``instance_name``, that writer) reaches ``token``."""
        return self._generator.wait_for_position(token, instance_name)

    async def read_persisted_positions(self) -> dict[str, int]:
        """Every writer's position as last written to the database."""
        return await self._generator.read_persisted_positions()

    def advance(self, instance_name: str, token: int) -> None:
        """A position learnt from elsewhere (replication); never moves one back."""
        self._generator.advance(instance_name, token)
