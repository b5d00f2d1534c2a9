"""Where the ``redactions`` table's SQL was: it is now
``roomstore.events.tables.events``'s (with ``events``, whose rows the
same-room join needs). Kept, SQL-free, only so that docs/architecture.md's
owner table (rewritten with issue 22's map) names a module that exists;
delete it with that rewrite.
"""

from roomstore.events.tables.events import (  # noqa: F401
    due_for_censoring_txn,
    first_redaction_sql,
    insert_redactions,
    mark_censored_txn,
    redactions_of_txn,
    same_room_redactions,
    unflagged_targets_txn,
)
