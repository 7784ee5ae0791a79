package eventplane.inbox;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.Collections;
import java.util.Iterator;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Columnar readers for the splits (rows, for a plan that asks for them, from the same). */
final class InboxReaderFactory implements PartitionReaderFactory {
  private static final long serialVersionUID = 1L;
  private final long batchId;
  private final InboxReader.VariantOptions variants; // null: no VARIANT columns
  private final RowFilter filter;

  InboxReaderFactory(long batchId, InboxReader.VariantOptions variants, RowFilter filter) {
    this.batchId = batchId;
    this.variants = variants;
    this.filter = filter;
  }

  @Override
  public boolean supportColumnarReads(InputPartition partition) {
    return true;
  }

  @Override
  public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
    return open(partition);
  }

  @Override
  public PartitionReader<InternalRow> createReader(InputPartition partition) {
    InboxReader batches = open(partition);
    return new PartitionReader<>() {
      private Iterator<InternalRow> rows = Collections.emptyIterator();
      private InternalRow current;

      @Override
      public boolean next() throws IOException {
        while (!rows.hasNext()) {
          if (!batches.next()) {
            return false;
          }
          rows = batches.get().rowIterator();
        }
        current = rows.next();
        return true;
      }

      @Override
      public InternalRow get() {
        return current;
      }

      @Override
      public void close() throws IOException {
        batches.close();
      }
    };
  }

  private InboxReader open(InputPartition partition) {
    InboxPartition p = (InboxPartition) partition;
    try {
      return new InboxReader(p.path(), p.offset(), p.length(), batchId, variants, filter, null);
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }
}
