"""Spark: the session (``session``), batch -> DataFrame (``frame``) and the
executor (``executor``), which drives the CDC tables of ``daemon.table``.

Imports nothing: pyspark loads only when a module here asks for it, so the CLI
imports ``daemon.*`` cheaply.
"""
