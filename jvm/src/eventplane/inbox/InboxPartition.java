package eventplane.inbox;

import org.apache.spark.sql.connector.read.InputPartition;

/** Bytes {@code [offset, offset + length)} of an inbox file: whole chunks, one task. */
record InboxPartition(String path, long offset, long length) implements InputPartition {}
