"""Spark: the session (``session``), batch -> DataFrame (``frame``) and the
executor (``executor``, with its session's life in ``lifecycle`` and retention
and quarantine runs in ``maintenance``), which drives the CDC tables of
``daemon.table``.

Imports nothing: pyspark loads only when a module here asks for it, so the CLI
imports ``daemon.*`` cheaply.
"""
