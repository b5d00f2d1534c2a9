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

from collections.abc import Mapping

from roomstore.storage.database import Transaction
from roomstore.storage.engines import Row
from roomstore.visibility.codes import MEMBERSHIP_CODES, NO_MEMBERSHIP_CODE, VISIBILITY_CODES
from roomstore.visibility.memberships import joined_after_sql, last_join_sql

JOIN = MEMBERSHIP_CODES["join"]
INVITE = MEMBERSHIP_CODES["invite"]
WORLD_READABLE = VISIBILITY_CODES["world_readable"]
SHARED = VISIBILITY_CODES["shared"]
INVITED = VISIBILITY_CODES["invited"]

#: A room with no history visibility event is ``shared`` (spec default).
DEFAULT_VISIBILITY = SHARED


def snapshot_facts_sql(snapshot_column: str) -> tuple[str, str]:
    """``(columns, joins)``: the facts of the snapshot ``snapshot_column``
    names (its branch, seq, history visibility, and its branch's tip seq; NULL
    when the column is) for a read of another owner's table to select and
    join (the state owner's ``group_facts_txn``)."""
    return (
        "s.branch_nid, s.seq, s.history_visibility, b.tip_seq",
        f" LEFT JOIN visibility_snapshots AS s ON s.snapshot_nid = {snapshot_column}"
        " LEFT JOIN visibility_branches AS b ON b.branch_nid = s.branch_nid",
    )


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
    joined_after = joined_after_sql(event_alias)
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


def snapshot_upto_sql(scope: str, alias: str = "cs") -> str:
    """SQL selecting ``snapshot_nid`` and ``upto`` of the snapshots
    ``visibility_snapshots AS <alias>`` matching ``scope`` (a condition on
    ``alias``) at which the viewer may see some event: the rules of
    ``allowed_sql`` applied once per snapshot rather than once per event.

    The viewer may see an event at such a snapshot exactly when its stream
    ordering is below ``upto``: the largest BIGINT where ``allowed_sql``
    holds for every event there (world_readable; the viewer's membership
    there is join; invited with an invite); for "shared", the stream
    ordering of the viewer's last join of the room (``allowed_sql``'s
    "joined after": some join of theirs comes later), NULL (no event) when
    they never joined. Snapshots where they may see nothing are left out.
    Binds the room nid and the viewer's user nid (their last join), the user
    nid again (their membership), then ``scope``'s parameters. ``alias`` must differ from the
    aliases ``membership_sql`` uses. (The LIMIT: PostgreSQL would otherwise
    copy the membership subquery into each use of ``m`` and plan it that
    many times.)
    """
    member = membership_sql(f"{alias}.snapshot_nid")
    last_join = last_join_sql()
    return f"""SELECT f.snapshot_nid AS snapshot_nid, CASE
            WHEN f.v = {WORLD_READABLE} OR f.m = {JOIN} OR (f.v = {INVITED} AND f.m = {INVITE})
                THEN 9223372036854775807
            ELSE {last_join} END AS upto
        FROM (SELECT {alias}.snapshot_nid AS snapshot_nid, {alias}.history_visibility AS v,
                CASE WHEN {alias}.history_visibility = {WORLD_READABLE} THEN {NO_MEMBERSHIP_CODE}
                     ELSE {member} END AS m
              FROM visibility_snapshots AS {alias} WHERE {scope} LIMIT 9223372036854775807) AS f
        WHERE f.v = {WORLD_READABLE} OR f.m = {JOIN} OR (f.v = {INVITED} AND f.m = {INVITE}) OR f.v = {SHARED}"""


def visible_params(user_nid: int, own_member_key_nid: int | None) -> list[int]:
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
        writes: VisibilityWrites | None = None,
    ) -> int:
        """The snapshot of a state derived from ``parent_snapshot``.

        ``membership_changes`` maps user nid to membership code for the users
        whose membership differs from the parent; ``visibility`` is the new
        history visibility code, or None if unchanged. With no parent the
        changes must list every member (a fresh branch is started). Returns
        the parent itself when nothing relevant changed. With ``writes`` the
        rows wait there until ``writes.flush()``; without, they are written now.
        """
        if parent_snapshot is not None and not membership_changes and visibility is None:
            return parent_snapshot
        own = writes if writes is not None else VisibilityWrites()
        if parent_snapshot is None:
            branch = own.new_branch(txn, room_nid, None)
            seq = 1
            hv = visibility if visibility is not None else DEFAULT_VISIBILITY
        else:
            parent_branch, parent_seq, parent_hv = own.snapshot(txn, parent_snapshot)
            hv = visibility if visibility is not None else parent_hv
            if own.tip(txn, parent_branch) == parent_seq:
                branch, seq = parent_branch, parent_seq + 1
            else:
                branch = own.new_branch(txn, room_nid, parent_snapshot)
                seq = 1
        snapshot = own.add_snapshot(txn, room_nid, branch, seq, hv, membership_changes)
        if writes is None:
            own.flush(txn)
        return snapshot


class VisibilityWrites:
    """The visibility rows one transaction makes, written together by ``flush``.

    It also remembers the snapshots and branch tips it has read or made, so
    a batch extending a branch event after event reads each once.
    ``expected``: how many snapshots the caller may make (ids reserved at once).
    """

    def __init__(self, expected: int = 1):
        self.expected = expected
        self._snapshots: dict[int, tuple[int, int, int]] = {}  # nid -> (branch, seq, history visibility)
        self._tips: dict[int, int] = {}
        self._new_branches: dict[int, tuple[int, int | None]] = {}  # branch -> (room, base snapshot)
        self._moved_tips: set[int] = set()
        # New branch -> its ancestry rows [(ancestor, upto seq, depth)], itself first at depth 0.
        self._ancestors: dict[int, list[tuple[int, int, int]]] = {}
        self._snapshot_rows: list[Row] = []
        self._membership_rows: list[Row] = []

    def ids_request(self) -> tuple[str, str, int]:
        """The ``expected`` snapshot ids, for ``Transaction.reserve_ids``."""
        return ("visibility_snapshots", "snapshot_nid", self.expected)

    def snapshot(self, txn: Transaction, snapshot_nid: int) -> tuple[int, int, int]:
        """(branch, seq, history visibility) of a snapshot."""
        known = self._snapshots.get(snapshot_nid)
        if known is None:
            row = txn.execute(
                "SELECT s.branch_nid, s.seq, s.history_visibility, b.tip_seq"
                " FROM visibility_snapshots AS s JOIN visibility_branches AS b ON b.branch_nid = s.branch_nid"
                " WHERE s.snapshot_nid = ?",
                (snapshot_nid,),
            ).fetchone()
            if row is None:
                raise LookupError(f"visibility snapshot {snapshot_nid} does not exist")
            known = self._snapshots[snapshot_nid] = (row[0], row[1], row[2])
            self._tips.setdefault(row[0], row[3])
        return known

    def learn(self, snapshot_nid: int, branch: int, seq: int, hv: int, tip: int) -> None:
        """Facts of a stored snapshot and its branch's tip, read by the caller
        in this transaction (spares reading them again)."""
        self._snapshots.setdefault(snapshot_nid, (branch, seq, hv))
        self._tips.setdefault(branch, tip)

    def tip(self, txn: Transaction, branch: int) -> int:
        tip = self._tips.get(branch)
        if tip is None:
            tip = self._tips[branch] = txn.select_one_value(
                "SELECT tip_seq FROM visibility_branches WHERE branch_nid = ?", (branch,)
            )
        return tip

    def new_branch(self, txn: Transaction, room_nid: int, base_snapshot: int | None) -> int:
        branch = txn.next_id("visibility_branches", "branch_nid")
        self._new_branches[branch] = (room_nid, base_snapshot)
        self._tips[branch] = 0
        ancestry = [(branch, 0, 0)]
        if base_snapshot is not None:
            base_branch, base_seq, _ = self.snapshot(txn, base_snapshot)
            # The base's own branch up to the base's seq, then the base
            # branch's ancestry as it was recorded (each with its own bound).
            ancestry.append((base_branch, base_seq, 1))
            ancestry.extend((ancestor, upto, depth + 1) for ancestor, upto, depth in self._ancestry(txn, base_branch))
        self._ancestors[branch] = ancestry
        return branch

    def _ancestry(self, txn: Transaction, branch: int) -> list[tuple[int, int, int]]:
        """(ancestor, upto seq, depth) of ``branch``, deepest last, itself left out."""
        if branch in self._ancestors:
            return self._ancestors[branch][1:]
        return [
            tuple(r)
            for r in txn.execute(
                "SELECT ancestor_branch_nid, upto_seq, depth FROM visibility_branch_ancestors"
                " WHERE branch_nid = ? AND depth > 0 ORDER BY depth",
                (branch,),
            ).fetchall()
        ]

    def add_snapshot(
        self, txn: Transaction, room_nid: int, branch: int, seq: int, hv: int, membership_changes: Mapping[int, int]
    ) -> int:
        snapshot = txn.next_id(*self.ids_request()[:2], self.expected)
        self._snapshots[snapshot] = (branch, seq, hv)
        self._tips[branch] = seq
        if branch not in self._new_branches:
            self._moved_tips.add(branch)
        self._snapshot_rows.append((snapshot, room_nid, branch, seq, hv))
        self._membership_rows.extend((branch, user, seq, code) for user, code in membership_changes.items())
        return snapshot

    def flush(self, txn: Transaction) -> None:
        txn.insert_many(
            "visibility_branches",
            ("branch_nid", "room_nid", "base_snapshot_nid", "tip_seq"),
            [(b, room, base, self._tips[b]) for b, (room, base) in sorted(self._new_branches.items())],
            queue=True,
        )
        txn.insert_many(
            "visibility_branch_ancestors",
            ("branch_nid", "ancestor_branch_nid", "upto_seq", "depth"),
            [(b, *row) for b in sorted(self._new_branches) for row in self._ancestors[b]],
            queue=True,
        )
        for branch in sorted(self._moved_tips):
            txn.queue("UPDATE visibility_branches SET tip_seq = ? WHERE branch_nid = ?", (self._tips[branch], branch))
        txn.insert_many(
            "visibility_snapshots",
            ("snapshot_nid", "room_nid", "branch_nid", "seq", "history_visibility"),
            self._snapshot_rows,
            queue=True,
        )
        txn.insert_many(
            "visibility_memberships", ("branch_nid", "user_nid", "seq", "membership"), self._membership_rows, queue=True
        )
        self._new_branches, self._moved_tips = {}, set()
        self._ancestors = {}
        self._snapshot_rows, self._membership_rows = [], []


def delete_room_visibility_txn(txn: Transaction, room_nid: int, counts: dict[str, int]) -> None:
    """Delete the room's snapshots, branches, their ancestry and membership
    rows (a purged room); ``counts`` gains the rows deleted per table."""
    branches = "SELECT b.branch_nid FROM visibility_branches AS b WHERE b.room_nid = ?"
    for table, where in (
        ("visibility_memberships", f"branch_nid IN ({branches})"),
        ("visibility_branch_ancestors", f"branch_nid IN ({branches})"),
        ("visibility_snapshots", "room_nid = ?"),
        ("visibility_branches", "room_nid = ?"),
    ):
        txn.execute(f"DELETE FROM {table} WHERE {where}", (room_nid,))
        counts[table] = counts.get(table, 0) + max(txn.rowcount, 0)
