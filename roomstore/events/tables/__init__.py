"""The event store's tables, one owner module each (or each family of
tables whose statements join), holding every statement that names them:

- ``events``: ``events``, ``event_json``, ``redactions``;
- ``event_graph``: ``event_edges``, ``event_auth_edges`` (prev and auth
  events, the auth chains walked over them);
- ``room_state``: ``forward_extremities``, ``backward_extremities``,
  ``current_state``, ``current_state_deltas``, ``current_memberships``.

``room_memberships`` is ``roomstore.visibility.memberships``'s (the history
visibility is judged by); the interning tables and the event store's columns
of ``rooms`` are ``roomstore.storage.interning``'s. The operations of
``roomstore.events`` (persist, reads, timeline, pagination, federation,
precheck, censor, stream rows) call these functions or embed their
fragments (``events_as``, ``join_events``, ...) in their composed reads.
"""
