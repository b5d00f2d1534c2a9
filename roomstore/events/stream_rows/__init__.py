"""The replication streams' rows: ``rows`` reads the events, backfill and
caches streams' rows (and their wire text) between two positions;
``pages`` is a page of each as ``RoomStore`` hands it to replication.
"""
