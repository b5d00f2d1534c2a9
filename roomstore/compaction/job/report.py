"""What a run reports: per-room figures, the run's totals, the summary files.

:class:`RoomReport` accumulates one room's chunk rows in the driver; the
summary is printed, written as JSON (``--summary-json``) and as Prometheus
text-format gauges (``--metrics-file``, :func:`write_metrics`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import attrs

@attrs.define
class RoomReport:
    """A room's figures as the driver accumulates them from chunk rows."""

    room_nid: int
    room_id: str = ""
    status: str = ""
    state_groups: int = 0
    chunks: int = 0
    rows_before: int = 0
    rows_after: int = 0
    rewritten: int = 0
    chain_updates: int = 0
    missing: int = 0
    mismatched: int = 0
    max_depth: int = 0
    detail: List[str] = attrs.Factory(list)
    error: str = ""
    earlier_attempt: bool = False
    # (first, last, rows_before, rows_after, rewritten, has_changes, already_done, chain_updates)
    chunk_list: List[Tuple[int, int, int, int, int, bool, bool, int]] = attrs.Factory(list)

    @property
    def saving(self) -> int:
        return self.rows_before - self.rows_after

    def as_json(self) -> Dict[str, Any]:
        return {
            "room_id": self.room_id,
            "room_nid": self.room_nid,
            "status": self.status,
            "state_groups": self.state_groups,
            "chunks": self.chunks,
            "rows_before": self.rows_before,
            "rows_after": self.rows_after,
            "rows_saved": self.saving,
            "groups_rewritten": self.rewritten,
            "chain_length_updates": self.chain_updates,
            "max_hops": self.max_depth,
            "missing_groups": self.missing,
            "mismatched_groups": self.mismatched,
            "detail": "; ".join(d for d in self.detail if d) or self.error,
            "earlier_attempt": self.earlier_attempt,
        }


STATUS_WRITTEN = "written"
STATUS_WOULD_WRITE = "would_write"
FAILED_STATUSES = ("mismatch", "error")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_metrics(path: str, summary: Mapping[str, Any]) -> None:
    """Prometheus text format (node-exporter textfile collector / pushgateway).

    Gauges describing the last run; written atomically (temporary file, then
    rename), so a scraper never reads half a file.
    """
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    registry = CollectorRegistry()
    totals = summary["totals"]
    prefix = "roomstore_state_compaction_"

    def gauge(name: str, doc: str, value: float, labels: Optional[Dict[str, str]] = None) -> None:
        if labels:
            g = Gauge(prefix + name, doc, list(labels), registry=registry)
            g.labels(**labels).set(value)
        else:
            Gauge(prefix + name, doc, registry=registry).set(value)

    failed = sum(totals["rooms_by_status"].get(s, 0) for s in FAILED_STATUSES)
    gauge("last_run_timestamp_seconds", "When the last compaction run started (Unix time)", summary["started_at"])
    gauge("last_run_duration_seconds", "Wall time of the last compaction run", summary["duration_s"])
    gauge("last_run_success", "1 if the last run left no room unverified or failed", 0 if failed else 1)
    gauge("last_run_dry_run", "1 if the last run was a dry run", 1 if summary["dry_run"] else 0)
    gauge("snapshot_max_state_group", "Highest state group the last run considered", summary["snapshot_max"] or 0)
    g = Gauge(prefix + "rooms", "Rooms examined by the last run, by outcome", ["status"], registry=registry)
    for status in ("written", "would_write", "unchanged", "below_min_saving", "mismatch", "error", "changed_underneath"):
        g.labels(status=status).set(totals["rooms_by_status"].get(status, 0))
    gauge("state_groups", "State groups examined by the last run", totals["state_groups"])
    gauge("rows_before", "Delta rows of the examined rooms before the last run", totals["rows_before"])
    gauge("rows_after", "Delta rows of the examined rooms after the last run (as planned)", totals["rows_after"])
    gauge("rows_saved", "Delta rows removed (or, dry run: removable) by the last run", totals["rows_saved"])
    gauge("groups_rewritten", "State groups given a new representation by the last run", totals["groups_rewritten"])
    gauge("mismatched_groups", "State groups whose verification failed (their rooms were not written)",
          totals["mismatched_groups"])
    gauge("missing_groups", "State groups skipped because their chain reaches a missing group", totals["missing_groups"])
    gauge("max_hops", "Longest predecessor chain after the last run", totals["max_hops"])
    write_to_textfile(path, registry)

