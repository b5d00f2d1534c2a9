"""TCP replication between the main process and its workers.

The public face:

- :class:`ReplicationServerFactory` (main process): serves the streams of a
  :class:`StreamRegistry`; call ``notify_new_rows(stream_name)`` when one
  advances.
- :class:`ReplicationClientFactory` + :class:`ReplicationClientHandler`
  (worker): follows the server's streams, reconnecting and resuming; a
  handler that applies many tokens in one call declares
  :class:`IBatchHandler` (``on_rdata_batch``) or :class:`IRowsHandler`
  (also ``on_rdata_rows``) with ``zope.interface.implementer``.
- :class:`Stream` (interface), :class:`InMemoryStream`, :class:`StreamRegistry`:
  what streams look like to the protocol.
- :class:`ReplicationConfig`: timeouts, limits and page sizes.
- :mod:`.commands`: the wire commands (``parse_command_from_line``,
  ``serialize_command``, ``CommandParseError``, ``UnknownCommandError``).

Wire format and behaviour follow Synapse's TCP replication protocol; see
:mod:`.connection` (and :mod:`.server_protocol`, :mod:`.client_protocol`) for the
choices made where it leaves room.
"""

from roomstore.replication.client import ReplicationClientFactory, ReplicationClientHandler
from roomstore.replication.client_protocol import ClientReplicationProtocol
from roomstore.replication.commands import (
    MAX_LINE_LENGTH,
    Command,
    CommandParseError,
    UnknownCommandError,
    parse_command_from_line,
    serialize_command,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.handler_interface import IBatchHandler, IRowsHandler
from roomstore.replication.server_factory import ReplicationServerFactory
from roomstore.replication.server_protocol import ServerReplicationProtocol
from roomstore.replication.stream_interface import (
    InMemoryStream,
    Stream,
    StreamRegistry,
    StreamUpdates,
    UnknownStreamError,
)

__all__ = [
    "MAX_LINE_LENGTH",
    "ClientReplicationProtocol",
    "Command",
    "CommandParseError",
    "IBatchHandler",
    "IRowsHandler",
    "InMemoryStream",
    "ReplicationClientFactory",
    "ReplicationClientHandler",
    "ReplicationConfig",
    "ReplicationServerFactory",
    "ServerReplicationProtocol",
    "Stream",
    "StreamRegistry",
    "StreamUpdates",
    "UnknownCommandError",
    "UnknownStreamError",
    "parse_command_from_line",
    "serialize_command",
]
