"""eventplane daemon: config, ingest, rings, consumers, micro-batches, Spark, service."""
