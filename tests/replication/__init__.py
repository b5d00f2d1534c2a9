"""Tests for roomstore.replication (the TCP replication protocol layer)."""
