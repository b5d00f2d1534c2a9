"""The read path: what a homeserver asks of stored events.

``event_reader`` serves events, their flags and state; ``timeline`` (recent
events, visibility), ``sync`` and ``sync_state`` (new events since a token,
each room's timeline and state block), ``pagination`` (back-pagination),
``user_rooms`` (a user's rooms by membership), ``federation`` (backfill,
missing events) and ``client_format`` (the client-server API's format) read
through it. Nothing here writes.
"""
