"""Where Spark reads from (driver side): :class:`JdbcSource`.

What it reads is the layout's (:meth:`roomstore.compaction.tables.StateTables.input_rows`);
:func:`roomstore.compaction.roomstore_tables.read_room_chunks` reads one room
of roomstore's tables exactly as the Spark job feeds it, with plain SQL (a
reference for tests and debugging). Nothing here knows a layout, so the
layouts' interface (:mod:`roomstore.compaction.tables`) can name this class.
"""

from __future__ import annotations

from typing import Any

import attrs

from roomstore.compaction.job.jdbc import jdbc_driver, jdbc_url
from roomstore.storage.engines import engine_from_url

__all__ = ["JdbcSource"]


@attrs.define
class JdbcSource:
    """Where Spark reads from: JDBC URL, driver class and connection properties."""

    url: str
    driver: str
    properties: dict[str, str]

    @classmethod
    def from_db_url(cls, db_url: str) -> JdbcSource:
        engine = engine_from_url(db_url)
        url, properties = jdbc_url(engine)
        return cls(url, jdbc_driver(engine).driver, properties)

    def read(self, spark: Any, table_sql: str, schema: str, partition: tuple[int, int, int] | None = None) -> Any:
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
