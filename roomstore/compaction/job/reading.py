"""Reading state groups for the job: the SQL the driver and Spark's JDBC reads run.

:class:`JdbcSource` is where Spark reads from; :func:`boundary_states_sql`
gives the full states of the groups that chunks build on;
:func:`read_room_chunks` reads one room exactly as the Spark job feeds it,
with plain SQL (a reference for tests and debugging).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import attrs
import numpy as np
import pyarrow as pa

from roomstore.compaction.job.executor import INPUT_COLUMNS, iter_chunks
from roomstore.storage.engines import engine_from_url

def boundary_states_sql(group_ids: Sequence[int]) -> str:
    """One statement giving the full state of each group in ``group_ids``.

    Rows ``(boundary_group, type_key_nid, event_nid)`` plus one row with NULL
    key per group whose chain is complete (ends at an existing snapshot);
    groups whose chain reaches a missing (purged) group get no rows at all,
    so the job treats them as unknown rather than as a wrong state. Works on
    PostgreSQL and SQLite (recursive CTE, window function).
    """
    if not group_ids:
        raise ValueError("no groups")
    values = ", ".join(f"({int(g)})" for g in group_ids)
    return f"""
WITH RECURSIVE wanted(start_group) AS (VALUES {values}),
chain(start_group, state_group, hops) AS (
    SELECT CAST(start_group AS BIGINT), CAST(start_group AS BIGINT), 0 FROM wanted
    UNION ALL
    SELECT chain.start_group, g.prev_state_group, chain.hops + 1
    FROM state_groups AS g JOIN chain ON g.state_group = chain.state_group
    WHERE g.prev_state_group IS NOT NULL AND chain.hops < 100000
),
complete(start_group) AS (
    SELECT DISTINCT chain.start_group FROM chain JOIN state_groups AS g ON g.state_group = chain.state_group
    WHERE g.prev_state_group IS NULL
)
SELECT start_group AS boundary_group, type_key_nid, event_nid FROM (
    SELECT chain.start_group, d.type_key_nid, d.event_nid,
           ROW_NUMBER() OVER (PARTITION BY chain.start_group, d.type_key_nid ORDER BY chain.hops) AS nearest
    FROM chain JOIN complete ON complete.start_group = chain.start_group
    JOIN state_group_deltas AS d ON d.state_group = chain.state_group
) AS ranked
WHERE nearest = 1 AND event_nid IS NOT NULL
UNION ALL
SELECT start_group, NULL, NULL FROM complete
"""


def read_room_chunks(
    writer: Any, room_nid: int, snapshot_max: int, chunk_groups: int
) -> Iterator[Dict[str, np.ndarray]]:
    """The chunks of one room exactly as the Spark job feeds them, read with
    plain SQL through ``writer`` (a reference for tests and debugging).
    """
    db = writer.db
    where = f"room_nid = {int(room_nid)}"
    starts_by_room, links = writer.chunk_layout(snapshot_max, chunk_groups, where)
    starts = starts_by_room.get(room_nid, [])
    need: Dict[int, List[int]] = {}
    for _, chunk, prev in links:
        need.setdefault(chunk, []).append(prev)
    states: Dict[int, List[Tuple[int, int, int]]] = {}
    all_prevs = sorted({p for prevs in need.values() for p in prevs})
    if all_prevs:
        for g, k, e in db.query(boundary_states_sql(all_prevs)):
            states.setdefault(g, []).append((-1 if k is None else k, -1 if e is None else e))
    groups = db.query(
        "SELECT state_group, prev_state_group, chain_length FROM state_groups"
        " WHERE room_nid = ? AND state_group <= ? ORDER BY state_group",
        (room_nid, snapshot_max),
    )
    deltas: Dict[int, List[Tuple[int, Optional[int]]]] = {}
    for g, k, e in db.query(
        "SELECT d.state_group, d.type_key_nid, d.event_nid FROM state_group_deltas d"
        " JOIN state_groups g ON g.state_group = d.state_group"
        " WHERE g.room_nid = ? AND d.state_group <= ? ORDER BY d.state_group, d.type_key_nid",
        (room_nid, snapshot_max),
    ):
        deltas.setdefault(g, []).append((k, e))
    rows: List[Tuple[int, ...]] = []
    for chunk, prevs in need.items():
        sort_id = 0 if chunk == 0 else starts[chunk - 1]
        for g in sorted(set(prevs)):
            for k, e in sorted(states.get(g, [])):
                rows.append((sort_id, 0, g, -1, -1, k, e))
    for g, p, chain in groups:
        for k, e in deltas.get(g) or [(-1, -1)]:
            rows.append((g, 1, g, -1 if p is None else p, chain, k, -1 if e is None else e))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[5]))
    if not rows:
        return
    cols = np.array(rows, dtype=np.int64).T
    arrays = {name: cols[i] for i, name in enumerate(INPUT_COLUMNS)}
    yield from iter_chunks([pa.RecordBatch.from_pydict(arrays)], starts)


@attrs.define
class JdbcSource:
    """Where Spark reads from: JDBC URL, driver class and connection properties."""

    url: str
    driver: str
    properties: Dict[str, str]

    @classmethod
    def from_db_url(cls, db_url: str) -> "JdbcSource":
        engine = engine_from_url(db_url)
        url, properties = engine.jdbc_url()
        return cls(url, engine.jdbc_driver, properties)

    def read(self, spark: Any, table_sql: str, schema: str, partition: Optional[Tuple[int, int, int]] = None) -> Any:
        reader = (
            spark.read.format("jdbc")
            .option("url", self.url)
            .option("driver", self.driver)
            .option("dbtable", table_sql)
            .option("customSchema", schema)
            .option("fetchsize", "10000")
        )
        for key, value in self.properties.items():
            reader = reader.option(key, value)
        if partition is not None:
            lo, hi, parts = partition
            reader = (
                reader.option("partitionColumn", "state_group")
                .option("lowerBound", str(lo))
                .option("upperBound", str(hi + 1))
                .option("numPartitions", str(max(1, parts)))
            )
        return reader.load()

