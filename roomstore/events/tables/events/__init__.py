"""The tables of the events themselves: ``events`` (one row per event: room,
type, orderings, flags, state groups, visibility snapshots), ``event_json``
(the exact bytes) and ``redactions``; every statement that names them, one
module per concern. The edges between events (prev and auth events) are
``event_graph``'s.

- ``fragments``: what composed statements embed (``events_as``,
  ``join_events``, ``SERVED_COLUMNS`` / ``served_joins``,
  ``first_redaction_sql``; the aliases are the caller's);
- ``writes``: new events' rows and bytes, redactions, censoring's rewrites;
- ``reads``: reads by event nid, graph facts, redactions of events;
- ``purging``: what ``roomstore.events.purge`` finds, rewrites and deletes;
- ``streams``: the events and backfill streams' pages and newest IDs;
- ``timeline_reads``: the composed timeline statements (sync, recent, a page
  of pagination), whose callers keep only parameters and row handling.

A redaction only counts when its target is stored in the *same room*:
``same_room_redactions`` is that join, written once, and every reader of
redactions goes through it. The redaction algorithm itself (what pruning
keeps) is ``roomstore.pdu.redaction_algorithm``.

This package exports the statements and functions of its modules, but for
``timeline_reads``, whose statements embed other owners' fragments (the
current memberships of ``room_state`` among them, which itself joins
``events``): callers import those from that module, so that importing this
package never goes round through ``room_state``.
"""

from __future__ import annotations

from roomstore.events.tables.events.fragments import (
    SERVED_COLUMN_COUNT,
    SERVED_COLUMNS,
    events_as,
    first_redaction_sql,
    join_event_json,
    join_events,
    same_room_redactions,
    served_joins,
)
from roomstore.events.tables.events.purging import (
    PurgeCandidate,
    delete_events_txn,
    events_upto_txn,
    graph_nids_txn,
    groups_in_use_txn,
    make_outliers_txn,
    redaction_targets_txn,
    referenced_nids_txn,
    room_event_nids_txn,
)
from roomstore.events.tables.events.reads import (
    StoredEvent,
    due_for_censoring_txn,
    graph_facts_txn,
    history_visibility_json_txn,
    json_txn,
    redactions_of_txn,
    rooms_and_types_txn,
    served_rows_txn,
    state_groups_row_txn,
    stored_before_txn,
    stored_events_txn,
    unflagged_targets_txn,
    visible_flag_txn,
)
from roomstore.events.tables.events.streams import (
    BACKFILL_EVENT_NID_STREAM_ROWS,
    BACKFILL_EVENT_STREAM_ROWS,
    LIVE_EVENT_NID_STREAM_ROWS,
    LIVE_EVENT_STREAM_ROWS,
    NEWEST_BACKFILL_STREAM_IDS,
    NEWEST_LIVE_STREAM_IDS,
    event_json_stream_rows_sql,
    event_page_bound_sql,
    event_stream_rows_sql,
)
from roomstore.events.tables.events.writes import (
    EVENT_COLUMNS,
    insert_event_json,
    insert_events,
    insert_redactions,
    mark_censored_txn,
    queue_flag_redacted,
    replace_json_txn,
)

__all__ = [
    "BACKFILL_EVENT_NID_STREAM_ROWS",
    "BACKFILL_EVENT_STREAM_ROWS",
    "EVENT_COLUMNS",
    "LIVE_EVENT_NID_STREAM_ROWS",
    "LIVE_EVENT_STREAM_ROWS",
    "NEWEST_BACKFILL_STREAM_IDS",
    "NEWEST_LIVE_STREAM_IDS",
    "SERVED_COLUMNS",
    "SERVED_COLUMN_COUNT",
    "PurgeCandidate",
    "StoredEvent",
    "delete_events_txn",
    "due_for_censoring_txn",
    "event_json_stream_rows_sql",
    "event_page_bound_sql",
    "event_stream_rows_sql",
    "events_as",
    "events_upto_txn",
    "first_redaction_sql",
    "graph_facts_txn",
    "graph_nids_txn",
    "groups_in_use_txn",
    "history_visibility_json_txn",
    "insert_event_json",
    "insert_events",
    "insert_redactions",
    "join_event_json",
    "join_events",
    "json_txn",
    "make_outliers_txn",
    "mark_censored_txn",
    "queue_flag_redacted",
    "redaction_targets_txn",
    "redactions_of_txn",
    "referenced_nids_txn",
    "replace_json_txn",
    "room_event_nids_txn",
    "rooms_and_types_txn",
    "same_room_redactions",
    "served_joins",
    "served_rows_txn",
    "state_groups_row_txn",
    "stored_before_txn",
    "stored_events_txn",
    "unflagged_targets_txn",
    "visible_flag_txn",
]
