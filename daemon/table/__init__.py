"""CDC tables: the format's commit protocol and everything that keeps a table.

Layers, each importing only from those below it (a test checks that no
project module imports in a circle, tests/test_imports.py):

- ``parquet``: ``CdcSink``, the Parquet folder format's sink (commit, recover,
  quarantine replay and purge); what ``daemon.spark.executor`` drives,
  through the ``sink.TableSink`` interface; ``parquetwrite`` is its step 1
  (the Parquet writes) and schema summaries.
- ``compact`` (with ``compactplan``, what to merge, and ``compactmerge``, the
  merge itself), ``retention``, ``rewrite``: maintenance of a table's files.
- ``quarantine``, ``snapshot`` (the generation seqlock and consistent reads),
  ``sparkio`` (select lists, writer options, the raw inbox), ``ledger``.
- ``layout`` (columns, writer options, file names), ``errors``, ``crash``
  (crash points), ``durable`` (fsync helpers).
"""
