package eventplane.inbox;

import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.internal.SQLConf;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** One raw inbox file as a table that can only be read whole, once per batch. */
final class InboxTable implements SupportsRead, ScanBuilder, Scan, Batch {
  private final String path;
  private final String splits;
  private final long batchId;
  private final boolean variants;
  private final RowFilter filter;

  InboxTable(CaseInsensitiveStringMap options) {
    variants = options.getBoolean("variants", false);
    filter = RowFilter.fromOptions(options.get("collections"), options.get("skip_lsns"));
    path = required(options, "path");
    splits = required(options, "splits");
    try {
      batchId = Long.parseLong(required(options, "batch_id"));
    } catch (NumberFormatException e) {
      throw new IllegalArgumentException("eventplane inbox: option batch_id is not an integer");
    }
  }

  private static String required(CaseInsensitiveStringMap options, String key) {
    String value = options.get(key);
    if (value == null) {
      throw new IllegalArgumentException("eventplane inbox: option " + key + " is required");
    }
    return value;
  }

  @Override
  public String name() {
    return "eventplane-inbox " + path;
  }

  @Override
  @SuppressWarnings("deprecation") // columns() derives from it; Spark 4 reads either
  public StructType schema() {
    return variants ? InboxSource.VARIANT_SCHEMA : InboxSource.SCHEMA;
  }

  @Override
  public Set<TableCapability> capabilities() {
    return Set.of(TableCapability.BATCH_READ);
  }

  @Override
  public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
    return this;
  }

  @Override
  public Scan build() {
    return this;
  }

  @Override
  public StructType readSchema() {
    return schema();
  }

  @Override
  public String description() {
    return name();
  }

  @Override
  public Batch toBatch() {
    return this;
  }

  @Override
  public ColumnarSupportMode columnarSupportMode() {
    return ColumnarSupportMode.SUPPORTED;
  }

  /** One partition per split the daemon wrote: it sized them for the session's cores. */
  @Override
  public InputPartition[] planInputPartitions() {
    return partitions(path, splits).toArray(new InputPartition[0]);
  }

  /** The splits of option {@code splits} ({@code offset:length,...}) of the file {@code path}. */
  static List<InboxPartition> partitions(String path, String splits) {
    List<InboxPartition> out = new ArrayList<>();
    if (!splits.isEmpty()) {
      for (String split : splits.split(",")) {
        int colon = split.indexOf(':');
        try {
          long offset = Long.parseLong(split.substring(0, colon));
          long length = Long.parseLong(split.substring(colon + 1));
          out.add(new InboxPartition(path, offset, length));
        } catch (RuntimeException e) {
          throw new IllegalArgumentException(
              "eventplane inbox: split '" + split + "' is not offset:length", e);
        }
      }
    }
    return out;
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    if (!variants) {
      return new InboxReaderFactory(batchId, null, filter);
    }
    // The session's parse_json settings, read here on the driver as parse_json reads them when
    // it is planned: the tasks then build the same VARIANTs.
    return new InboxReaderFactory(
        batchId, InboxReader.VariantOptions.of(SQLConf.get()), filter);
  }
}
