"""Visibility computed eagerly, at persist time, and read through one join.

Whether user U may see event E depends on two things in the state at E: the
history visibility and U's membership (plus, for ``shared``, whether U joined
after E). Events between two changes of either share a *snapshot*; every
state group points at its snapshot (``state_groups.visibility_snapshot``), so
a plain message costs no visibility rows at all, and a membership change
costs one ``visibility_memberships`` row — never one row per member.

Snapshots lie on *branches*. A snapshot derived from the tip of its parent's
branch extends that branch (the linear case); one derived from an older
snapshot (a fork in the room graph) starts a new branch based there.
``visibility_branch_ancestors`` lists each branch's ancestry with the seq up
to which each ancestor's rows apply, so U's membership in snapshot S is the
newest ``visibility_memberships`` row of U along that ancestry: a join, not a
state lookup.

Who calls it: the event persister (``snapshot_for``), inside its transaction;
the readers embed ``visible_sql`` in their queries.
"""

from __future__ import annotations

from typing import Mapping

from roomstore.storage.database import Transaction
from roomstore.visibility.rules import MEMBERSHIP_CODES, NO_MEMBERSHIP_CODE, VISIBILITY_CODES

JOIN = MEMBERSHIP_CODES["join"]
INVITE = MEMBERSHIP_CODES["invite"]
WORLD_READABLE = VISIBILITY_CODES["world_readable"]
SHARED = VISIBILITY_CODES["shared"]
INVITED = VISIBILITY_CODES["invited"]

#: A room with no history visibility event is ``shared`` (spec default).
DEFAULT_VISIBILITY = SHARED


def membership_sql(snapshot_expr: str, user_param: str = "?") -> str:
    """SQL for the viewer's membership code in a snapshot (0: none).

    ``snapshot_expr`` names the snapshot id column; the expression binds one
    parameter, the viewer's user nid.
    """
    return f"""COALESCE((
        SELECT vm.membership
        FROM visibility_snapshots AS vs
        JOIN visibility_branch_ancestors AS va ON va.branch_nid = vs.branch_nid
        JOIN visibility_memberships AS vm
          ON vm.branch_nid = va.ancestor_branch_nid AND vm.user_nid = {user_param}
         AND vm.seq <= CASE WHEN va.depth = 0 THEN vs.seq ELSE va.upto_seq END
        WHERE vs.snapshot_nid = {snapshot_expr}
        ORDER BY va.depth ASC, vm.seq DESC
        LIMIT 1), {NO_MEMBERSHIP_CODE})"""


def allowed_sql(snapshot_expr: str, event_alias: str) -> str:
    """SQL true when the rules allow the viewer to see an event at a snapshot.

    Binds two parameters, both the viewer's user nid (membership; joined
    after).
    """
    hv = f"(SELECT history_visibility FROM visibility_snapshots WHERE snapshot_nid = {snapshot_expr})"
    member = membership_sql(snapshot_expr)
    joined_after = f"""EXISTS (
        SELECT 1 FROM room_memberships AS later
        WHERE later.room_nid = {event_alias}.room_nid AND later.user_nid = ?
          AND later.membership = {JOIN} AND later.stream_ordering > {event_alias}.stream_ordering)"""
    return f"""(CASE
        WHEN {hv} = {WORLD_READABLE} THEN 1
        ELSE (SELECT CASE
            WHEN m = {JOIN} THEN 1
            WHEN v = {SHARED} AND {joined_after} THEN 1
            WHEN v = {INVITED} AND m = {INVITE} THEN 1
            ELSE 0 END
          FROM (SELECT {hv} AS v, {member} AS m) AS facts)
        END) = 1"""


def visible_sql(event_alias: str = "e") -> tuple[str, int]:
    """SQL true when the viewer may see the event aliased ``event_alias``.

    Returns (sql, number of parameters); every parameter is the viewer's user
    nid, followed by the viewer's ``(m.room.member, user)`` key nid once.
    The state before the event decides, except that for history visibility
    events and the viewer's own membership events the state after counts too.
    """
    before = allowed_sql(f"{event_alias}.visibility_before", event_alias)
    after = allowed_sql(f"{event_alias}.visibility_after", event_alias)
    sql = f"""({event_alias}.visibility_before IS NOT NULL AND ({before}
        OR ({event_alias}.visibility_after IS NOT NULL
            AND ({event_alias}.type = 'm.room.history_visibility' OR {event_alias}.type_key_nid = ?)
            AND {after})))"""
    return sql, 5


def visible_params(user_nid: int, own_member_key_nid: int | None) -> list:
    """The parameters of ``visible_sql`` for a viewer, in order."""
    # before: membership, joined-after; own key; after: membership, joined-after
    return [user_nid, user_nid, own_member_key_nid if own_member_key_nid is not None else -1, user_nid, user_nid]


class VisibilityStore:
    """Writes snapshots, branches and membership rows at persist time."""

    def snapshot_for(
        self,
        txn: Transaction,
        room_nid: int,
        parent_snapshot: int | None,
        membership_changes: Mapping[int, int],
        visibility: int | None,
    ) -> int:
        """The snapshot of a state derived from ``parent_snapshot``.

        ``membership_changes`` maps user nid to membership code for the users
        whose membership differs from the parent; ``visibility`` is the new
        history visibility code, or None if unchanged. With no parent the
        changes must list every member (a fresh branch is started). Returns
        the parent itself when nothing relevant changed.
        """
        if parent_snapshot is not None and not membership_changes and visibility is None:
            return parent_snapshot
        if parent_snapshot is None:
            branch = self._new_branch(txn, room_nid, None)
            seq = 1
            hv = visibility if visibility is not None else DEFAULT_VISIBILITY
        else:
            parent_branch, parent_seq, parent_hv, tip = txn.execute(
                "SELECT s.branch_nid, s.seq, s.history_visibility, b.tip_seq"
                " FROM visibility_snapshots AS s JOIN visibility_branches AS b ON b.branch_nid = s.branch_nid"
                " WHERE s.snapshot_nid = ?",
                (parent_snapshot,),
            ).fetchone()
            hv = visibility if visibility is not None else parent_hv
            if tip == parent_seq:
                branch, seq = parent_branch, parent_seq + 1
            else:
                branch = self._new_branch(txn, room_nid, parent_snapshot)
                seq = 1
        txn.execute("UPDATE visibility_branches SET tip_seq = ? WHERE branch_nid = ?", (seq, branch))
        (snapshot,) = txn.allocate_ids("visibility_snapshots", "snapshot_nid", 1)
        txn.execute(
            "INSERT INTO visibility_snapshots (snapshot_nid, room_nid, branch_nid, seq, history_visibility)"
            " VALUES (?, ?, ?, ?, ?)",
            (snapshot, room_nid, branch, seq, hv),
        )
        txn.insert_many(
            "visibility_memberships",
            ("branch_nid", "user_nid", "seq", "membership"),
            [(branch, user, seq, code) for user, code in membership_changes.items()],
        )
        return snapshot

    def _new_branch(self, txn: Transaction, room_nid: int, base_snapshot: int | None) -> int:
        (branch,) = txn.allocate_ids("visibility_branches", "branch_nid", 1)
        txn.execute(
            "INSERT INTO visibility_branches (branch_nid, room_nid, base_snapshot_nid, tip_seq) VALUES (?, ?, ?, 0)",
            (branch, room_nid, base_snapshot),
        )
        ancestry = [(branch, branch, 0, 0)]
        if base_snapshot is not None:
            base_branch, base_seq = txn.execute(
                "SELECT branch_nid, seq FROM visibility_snapshots WHERE snapshot_nid = ?", (base_snapshot,)
            ).fetchone()
            # The base's own branch up to the base's seq, then the base
            # branch's ancestry as it was recorded (each with its own bound).
            ancestry.append((branch, base_branch, base_seq, 1))
            for ancestor, upto, depth in txn.execute(
                "SELECT ancestor_branch_nid, upto_seq, depth FROM visibility_branch_ancestors"
                " WHERE branch_nid = ? AND depth > 0 ORDER BY depth",
                (base_branch,),
            ).fetchall():
                ancestry.append((branch, ancestor, upto, depth + 1))
        txn.insert_many(
            "visibility_branch_ancestors", ("branch_nid", "ancestor_branch_nid", "upto_seq", "depth"), ancestry
        )
        return branch
