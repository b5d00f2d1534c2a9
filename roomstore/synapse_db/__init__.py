"""Reading a Synapse database: import its rooms into a ``RoomStore``, and
check an import against it.

This package uses the store (``RoomStore``'s public methods) and Synapse's
database (read only, ``source.py`` holds every statement against it); the
store never imports it.

    reader = await SynapseReader.open("sqlite:///path/homeserver.db", reactor)
    summary = await import_synapse(store, reader)
    checked = await verify_synapse(store, reader)
"""

from roomstore.synapse_db.importer import ImportSummary, import_synapse
from roomstore.synapse_db.reader import SynapseReader
from roomstore.synapse_db.source import SUPPORTED_SCHEMA, SynapseDatabaseError, SynapseEvent, SynapseSource
from roomstore.synapse_db.verifier import VerifySummary, verify_synapse

__all__ = [
    "ImportSummary",
    "SUPPORTED_SCHEMA",
    "SynapseDatabaseError",
    "SynapseEvent",
    "SynapseReader",
    "SynapseSource",
    "VerifySummary",
    "import_synapse",
    "verify_synapse",
]
