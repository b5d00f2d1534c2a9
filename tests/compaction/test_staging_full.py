"""The compaction job out of space in its staging tables (issue 24, item 3).

PostgreSQL: the staging tables (and their indexes) are moved to a tablespace on
a small tmpfs the test mounts (root only), so staging a chunk fails with
PostgreSQL's ``disk_full``. The job (``bin/roomstore-compact``, a real Spark
run) stops with one line saying so, no traceback, a non-zero exit, and every
group's state unchanged; once the tmpfs is grown the same job completes.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
import urllib.parse

from twisted.internet import threads
from twisted.trial import unittest

from tests.compaction.test_spark_job import run_job
from tests.compaction.test_write_back import (
    all_states,
    chain_lengths_are_depths,
    compaction_database,
    delta_rows,
    query,
)
from tests.db import POSTGRES_ADMIN_URL, DatabaseTestMixin

STAGING = ("state_compaction_staged_groups", "state_compaction_staged_deltas")
INDEXES = ("state_compaction_staged_groups_chunk", "state_compaction_staged_deltas_chunk")


def _autocommit(url: str, *statements: str) -> None:
    import psycopg2

    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


class StagingOutOfSpaceTests(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"
    timeout = 900

    def small_tablespace(self, url: str, size: str) -> str:
        """A tablespace on a tmpfs of ``size`` holding ``url``'s staging tables; its mount point."""
        if os.geteuid() != 0:
            raise unittest.SkipTest("mounting a small tmpfs needs root (bin/test runs as root in CI)")
        owner = pwd.getpwnam("postgres")  # the server's user (bin/pg-test-server)
        directory = tempfile.mkdtemp(prefix="roomstore-tablespace-")
        subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={size},uid={owner.pw_uid},gid={owner.pw_gid},mode=0700",
                "tmpfs",
                directory,
            ],
            check=True,
        )

        def unmount() -> None:
            if subprocess.run(["umount", directory]).returncode != 0:
                subprocess.run(["umount", "-l", directory])
            os.rmdir(directory)

        self.addCleanup(unmount)
        name = f"rs_small_{os.getpid()}_{os.path.basename(directory).replace('-', '_').lower()}"
        _autocommit(POSTGRES_ADMIN_URL, f"CREATE TABLESPACE {name} LOCATION '{directory}'")

        def drop() -> None:
            # The database is dropped after this cleanup: move its tables back first.
            try:
                _autocommit(
                    url,
                    *[f"ALTER TABLE {t} SET TABLESPACE pg_default" for t in STAGING],
                    *[f"ALTER INDEX {i} SET TABLESPACE pg_default" for i in INDEXES],
                )
            except Exception:
                pass  # the database is gone already
            _autocommit(POSTGRES_ADMIN_URL, f"DROP TABLESPACE {name}")

        self.addCleanup(drop)
        _autocommit(
            url,
            *[f"ALTER TABLE {t} SET TABLESPACE {name}" for t in STAGING],
            *[f"ALTER INDEX {i} SET TABLESPACE {name}" for i in INDEXES],
        )
        return directory

    async def test_out_of_space_while_staging_changes_no_state_and_says_so(self):
        url = await compaction_database(self)
        self.assertTrue(urllib.parse.urlsplit(url).scheme.startswith("postgres"))
        directory = self.small_tablespace(url, "64k")
        before = all_states(url)
        rows_before = delta_rows(url)

        status, output = await threads.deferToThread(run_job, url)
        self.assertNotEqual(status, 0, output)
        stopped = [line for line in output.splitlines() if "compaction stopped:" in line]
        self.assertEqual(len(stopped), 1, output)
        self.assertIn("is out of space (could not extend file", stopped[0])
        self.assertIn("No state group's state changed", stopped[0])
        self.assertIn("run it again: it resumes", stopped[0])
        self.assertNotIn("Traceback", output)
        self.assertEqual(all_states(url), before)
        chain_lengths_are_depths(self, url)
        self.assertEqual(query(url, "SELECT COUNT(*) FROM maintenance_locks")[0][0], 0)  # lock released

        # Space freed: the same job resumes and completes.
        subprocess.run(["mount", "-o", "remount,size=100m", directory], check=True)
        status, output = await threads.deferToThread(run_job, url)
        self.assertEqual(status, 0, output)
        self.assertEqual(all_states(url), before)
        self.assertLess(delta_rows(url), rows_before, output)
        chain_lengths_are_depths(self, url)
        for table in STAGING:
            self.assertEqual(query(url, f"SELECT COUNT(*) FROM {table}")[0][0], 0, table)
