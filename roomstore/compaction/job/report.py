"""What a run reports: per-room figures, the run's totals, the summary files.

:class:`RoomReport` accumulates one room's chunk rows in the driver; the
summary is printed, written as JSON (``--summary-json``) and as Prometheus
text-format gauges (``--metrics-file``, :func:`write_metrics`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

from roomstore.compaction.write_back import RoomOutcome


@attrs.frozen
class ChunkRecord:
    """One chunk of a room as the driver saw it come back from the executors.

    ``rows_before``/``rows_after``/``rewritten`` are the recorded figures when
    an interrupted attempt already swapped the chunk in (``already_done``).
    """

    first_group: int
    last_group: int
    rows_before: int
    rows_after: int
    rewritten: int
    chain_updates: int
    has_changes: bool
    already_done: bool

    @property
    def to_swap(self) -> bool:
        return self.has_changes and not self.already_done


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
    detail: list[str] = attrs.Factory(list)
    error: str = ""
    earlier_attempt: bool = False
    chunk_list: list[ChunkRecord] = attrs.Factory(list)

    @property
    def saving(self) -> int:
        return self.rows_before - self.rows_after

    def outcome(self) -> RoomOutcome:
        """The room's ``state_compaction_rooms`` record."""
        return RoomOutcome(
            self.room_nid,
            self.status,
            self.state_groups,
            self.rows_before,
            self.rows_after,
            self.rewritten,
            "; ".join(d for d in self.detail if d) or self.error,
        )

    def as_json(self) -> dict[str, Any]:
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


def run_totals(rooms: Sequence[RoomReport]) -> dict[str, Any]:
    """The run's figures over every room examined (resumed ones included)."""
    by_status: dict[str, int] = {}
    for r in rooms:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    written = [r for r in rooms if r.status in (STATUS_WRITTEN, STATUS_WOULD_WRITE)]
    return {
        "rooms": len(rooms),
        "rooms_by_status": by_status,
        "state_groups": sum(r.state_groups for r in rooms),
        "rows_before": sum(r.rows_before for r in rooms),
        "rows_after": sum(r.rows_after for r in rooms),
        "rows_written_before": sum(r.rows_before for r in written),
        "rows_written_after": sum(r.rows_after for r in written),
        "rows_saved": sum(r.saving for r in written),
        "groups_rewritten": sum(r.rewritten for r in written),
        "mismatched_groups": sum(r.mismatched for r in rooms),
        "missing_groups": sum(r.missing for r in rooms),
        "max_hops": max((r.max_depth for r in rooms), default=0),
    }


def report_lines(
    rooms: Sequence[RoomReport], totals: Mapping[str, Any], dry_run: bool, seconds: float, warnings: int
) -> list[str]:
    """The table printed at the end of a run: the 20 rooms saving most, then the totals."""
    lines = ["", f"{'room':<40} {'status':<18} {'groups':>9} {'rows before':>12} {'rows after':>11} {'saved':>8}"]
    shown = sorted(rooms, key=lambda r: (-r.saving, r.room_nid))[:20]
    for r in shown:
        name = r.room_id or f"<room_nid {r.room_nid}>"
        if len(name) > 40:
            name = name[:37] + "..."
        pct = f"{r.saving / r.rows_before:.0%}" if r.rows_before else "-"
        lines.append(
            f"{name:<40} {r.status:<18} {r.state_groups:>9,} {r.rows_before:>12,} {r.rows_after:>11,} {pct:>8}"
        )
    if len(rooms) > len(shown):
        lines.append(f"... and {len(rooms) - len(shown)} more room(s) (see --summary-json)")
    saved = totals["rows_saved"]
    verb = "would save" if dry_run else "saved"
    lines.append(
        f"total: {totals['rooms']} room(s) {totals['rooms_by_status']}; {totals['rows_before']:,} -> "
        f"{totals['rows_after']:,} rows in the rooms examined; {verb} {saved:,} rows in {seconds:.1f}s"
    )
    if not dry_run and saved:
        lines.append("note: tables do not shrink on disk by themselves; see docs/compaction.md (VACUUM)")
    if warnings:
        lines.append(f"{warnings} warning(s); see above or the summary JSON")
    return lines


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_metrics(path: str, summary: Mapping[str, Any]) -> None:
    """Prometheus text format (node-exporter textfile collector / pushgateway).

    Gauges describing the last run; written atomically (temporary file, then
    rename), so a scraper never reads half a file.
    """
    registry = CollectorRegistry()
    totals = summary["totals"]
    prefix = "roomstore_state_compaction_"

    def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> None:
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
    for status in (
        "written",
        "would_write",
        "unchanged",
        "below_min_saving",
        "mismatch",
        "error",
        "changed_underneath",
    ):
        g.labels(status=status).set(totals["rooms_by_status"].get(status, 0))
    gauge("state_groups", "State groups examined by the last run", totals["state_groups"])
    gauge("rows_before", "Delta rows of the examined rooms before the last run", totals["rows_before"])
    gauge("rows_after", "Delta rows of the examined rooms after the last run (as planned)", totals["rows_after"])
    gauge("rows_saved", "Delta rows removed (or, dry run: removable) by the last run", totals["rows_saved"])
    gauge("groups_rewritten", "State groups given a new representation by the last run", totals["groups_rewritten"])
    gauge(
        "mismatched_groups",
        "State groups whose verification failed (their rooms were not written)",
        totals["mismatched_groups"],
    )
    gauge(
        "missing_groups", "State groups skipped because their chain reaches a missing group", totals["missing_groups"]
    )
    gauge("max_hops", "Longest predecessor chain after the last run", totals["max_hops"])
    write_to_textfile(path, registry)
