"""The file spark-submit runs: ``spark-submit [options] spark_job.py --db URL ...``.

A thin entry into :func:`roomstore.compaction.job.driver.main`; the job is the
package :mod:`roomstore.compaction.job` (options, submit: the launcher behind
``bin/roomstore-compact``, executor, reading, driver, report). Usually started
through ``bin/roomstore-compact``; docs/compaction.md is the operator's guide.
"""

import os
import sys

if __name__ == "__main__":
    # spark-submit runs this file as a script: its directory (roomstore/compaction)
    # is sys.path[0], where write_back.py & co. would shadow top-level names, and the
    # executors must find the functions by their package name (from --py-files).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import warnings

    # pyspark warns on import about newer pandas; the job's own checks cover what it uses.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\..*)?")
    from roomstore.compaction.job.driver import main

    sys.exit(main())
