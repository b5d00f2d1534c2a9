"""The state-group compaction Spark job, one module per process and concern.

- :mod:`~roomstore.compaction.job.options`: the job's and the launcher's options, exit codes.
- :mod:`~roomstore.compaction.job.submit`: the launcher (``bin/roomstore-compact``) that execs spark-submit.
- :mod:`~roomstore.compaction.job.executor`: what Spark's Python workers run, one room chunk by chunk.
- :mod:`~roomstore.compaction.job.reading`: where Spark reads from (the JDBC source).
- :mod:`~roomstore.compaction.job.driver`: the driver: plans the Spark job, stages and swaps the results.
- :mod:`~roomstore.compaction.job.report`: per-room figures, totals, summary JSON and metrics.

``roomstore/compaction/spark_job.py`` is the thin file spark-submit runs.
Importing this package does not import pyspark.
"""
