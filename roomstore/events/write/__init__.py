"""The write path: a batch of events from bytes to committed rows.

``pipeline`` (with ``validation_worker``: parsing and hashing off the
reactor, in worker processes) orders the calls; ``batch`` and
``batch_rooms`` are a batch's values and the rooms it needs; ``precheck``
looks before stream IDs are taken; ``persist`` writes the batch in one
transaction, with ``batch_state`` (its state groups and snapshots),
``current_state`` (the rooms' ends and current state), ``auth_checks`` and
``redaction_authority`` (the room's rules on every event) and
``client_txns`` (client transaction IDs recorded with their events).
"""
