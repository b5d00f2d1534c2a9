"""The event store's tables, one owner module each (or each family of
tables whose statements join), holding every statement that names them:

- ``events`` (a package, one module per concern): ``events``, ``event_json``,
  ``redactions``, and the composed timeline reads about events
  (``events.timeline_reads``: sync's, recent's, a page's statements);
- ``event_graph``: ``event_edges``, ``event_auth_edges`` (prev and auth
  events, the auth chains walked over them);
- ``room_state``: ``forward_extremities``, ``backward_extremities``,
  ``current_state``, ``current_state_deltas``, ``current_memberships``.

``room_memberships`` is ``roomstore.visibility.memberships``'s (the history
visibility is judged by); the interning tables and the event store's columns
of ``rooms`` are ``roomstore.storage.interning``'s. The operations of
``roomstore.events`` (persist, reads, timeline, pagination, federation,
precheck, censor, stream rows) call these functions and run these
statements, keeping their parameters and row handling; a statement joining
several tables lives in the owner of the table it is about (composed reads,
``tests/test_architecture.py``'s ``COMPOSED_READS``).
"""
