"""Pure PDU code: room versions, parsing and validation, hashes, signatures,
content hashes, the redaction algorithm, power levels and the authorization
rules (``auth_rules``).

Nothing here touches a database, a stream or the store: each module imports
only the standard library, its third-party helpers and other modules of this
package.  ``roomstore.events`` re-exports the names embedders use.
"""
