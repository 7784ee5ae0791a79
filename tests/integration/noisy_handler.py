"""A ``[[cdc.handlers]]`` function that makes every kind of log output a daemon
can produce: a Python warning, a JVM log line with a Java stack trace, a
py4j/pyspark-style stdlib log record, and an exception nobody catches in a
thread. Named as ``tests.integration.noisy_handler:noisy`` by test_json_logs."""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

MARK = "eventplane-test-noise"


def noisy(df: Any, batch_id: int) -> None:
    warnings.warn(f"{MARK}: a Python warning in batch {batch_id}", UserWarning, stacklevel=1)
    jvm = df.sparkSession._jvm
    logger = jvm.org.apache.logging.log4j.LogManager.getLogger("eventplane.test.jvm")
    logger.warn(f"{MARK}: a JVM line", jvm.java.lang.IllegalStateException(f"{MARK}: java boom"))
    logging.getLogger("pyspark.test").warning("%s: a stdlib record", MARK)

    def explode() -> None:
        raise RuntimeError(f"{MARK}: uncaught in a thread")

    t = threading.Thread(target=explode, name="noisy-thread")
    t.start()
    t.join()
