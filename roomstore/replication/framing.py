"""Newline framing for a replication connection: bytes in, whole lines out.

:class:`LineFramedProtocol` is ``LineOnlyReceiver``'s contract (``lineReceived``,
``lineLengthExceeded``, ``MAX_LENGTH``, stop at ``transport.disconnecting``)
with its own buffer, plus one hook Twisted lacks: :meth:`linesReceived` gets
every whole line of a read at once, so a side that reads pages of RDATA can
parse them together instead of line by line.
"""

from __future__ import annotations

from typing import Any, ClassVar

from twisted.internet.protocol import Protocol

__all__ = ["LineFramedProtocol"]


class LineFramedProtocol(Protocol):
    """Cuts the byte stream at ``delimiter`` and hands on whole lines.

    A line over ``MAX_LENGTH`` bytes (whole, or a partial one that has grown
    past it) goes to :meth:`lineLengthExceeded` instead, and nothing after it
    in that read is delivered.
    """

    #: A TCP transport, a TLS one or a test's: ``disconnecting`` is read,
    #: which ``ITransport`` does not declare.
    transport: Any
    delimiter: ClassVar[bytes] = b"\n"
    MAX_LENGTH: int = 16384
    #: The start of a line whose delimiter has not arrived yet.
    _partial: bytes = b""

    @property
    def partial_line(self) -> bytes:
        """Bytes held for a line not yet complete."""
        return self._partial

    def discard_partial_line(self) -> None:
        """Drop the held partial line (a huge one need not stay in memory)."""
        self._partial = b""

    def dataReceived(self, data: bytes) -> None:
        if self._partial:
            data = self._partial + data
        end = data.rfind(self.delimiter)
        if end < 0:
            self._partial = data
        else:
            block = data[:end]
            self._partial = data[end + len(self.delimiter) :]
            del data
            lines = block.split(self.delimiter)
            if max(map(len, lines)) <= self.MAX_LENGTH:
                self.linesReceived(block, lines)
            elif not self._deliver_until_too_long(lines):
                return
        if len(self._partial) > self.MAX_LENGTH and not self.transport.disconnecting:
            self.lineLengthExceeded(self._partial)

    def _deliver_until_too_long(self, lines: list[bytes]) -> bool:
        """Deliver ``lines`` one by one up to the first too long; False once
        delivery stopped (a long line, or the connection closing)."""
        for line in lines:
            if self.transport.disconnecting:
                return False
            if len(line) > self.MAX_LENGTH:
                self.lineLengthExceeded(line)
                return False
            self.lineReceived(line)
        return True

    def linesReceived(self, block: bytes, lines: list[bytes]) -> None:
        """A read's whole lines, none too long (``block``: them joined by the
        delimiter). By default each goes to :meth:`lineReceived` until the
        transport starts disconnecting."""
        for line in lines:
            if self.transport.disconnecting:
                return
            self.lineReceived(line)

    def lineReceived(self, line: bytes) -> None:
        """One line, without its delimiter."""
        raise NotImplementedError

    def lineLengthExceeded(self, line: bytes) -> None:
        """A line over ``MAX_LENGTH``: by default, drop the connection."""
        self.transport.loseConnection()
