"""Spark: the session (``session``), batch -> DataFrame (``frame``), the executor
(``executor``) and the exactly-once CDC sink (``cdc``).

Imports nothing: pyspark loads only when a module here asks for it, so the CLI
imports ``daemon.*`` cheaply.
"""
