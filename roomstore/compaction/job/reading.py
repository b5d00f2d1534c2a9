"""Reading state groups for the job (driver side): where Spark reads from, and one room read locally.

:class:`JdbcSource` is where Spark reads from; the full states of the groups
that chunks build on come from the state owner's statement
(:func:`roomstore.state.groups.full_state_sql` with the groups' ids);
:func:`read_room_chunks` reads one room exactly as the Spark job feeds it,
with plain SQL (a reference for tests and debugging).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import attrs
import numpy as np
import pyarrow as pa

from roomstore.compaction import sql
from roomstore.compaction.job.executor import INPUT_COLUMNS, iter_chunks
from roomstore.state.groups import full_state_sql
from roomstore.storage.engines import engine_from_url


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
        for g, k, e in db.query(full_state_sql(all_prevs)):
            states.setdefault(g, []).append((-1 if k is None else k, -1 if e is None else e))
    groups = db.query(sql.ROOM_GROUPS, (room_nid, snapshot_max))
    deltas: Dict[int, List[Tuple[int, Optional[int]]]] = {}
    for g, k, e in db.query(sql.ROOM_DELTAS, (room_nid, snapshot_max)):
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

