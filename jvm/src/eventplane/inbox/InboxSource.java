package eventplane.inbox;

import java.util.Map;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * A Spark data source over the daemon's raw inbox files: a batch's WAL payloads as the WAL
 * holds them, decoded here in Spark's tasks instead of in the daemon's interpreter.
 *
 * <p>The daemon writes a batch's rows as chunks (the format is in {@link InboxReader}) and reads
 * them with {@code spark.read.format("eventplane.inbox.InboxSource")}, options {@code path},
 * {@code splits} ({@code offset:length} pairs separated by commas, one Spark task each, every
 * split whole chunks), {@code batch_id} (the value of the {@code batch_id} column) and
 * optionally {@code variants} ({@code true}: also {@code new}/{@code old} as VARIANT). The
 * schema is fixed ({@link #SCHEMA}); it is the Parquet inbox's, column for column, so the rest
 * of the batch's plan does not know which inbox it read (docs/performance.md, "The raw inbox").
 */
public final class InboxSource implements TableProvider {
  /**
   * The batch's input columns, in the order the Parquet inbox has them, and nullable as its
   * columns are read: the CDC table's files take their schema from here, and one table must
   * have one physical schema, whichever inbox a batch came through.
   */
  public static final StructType SCHEMA =
      new StructType()
          .add("lsn", DataTypes.LongType)
          .add("core", DataTypes.IntegerType)
          .add("seq", DataTypes.LongType)
          .add("collection", DataTypes.StringType)
          .add("op", DataTypes.StringType)
          .add("key", DataTypes.StringType)
          .add("new_json", DataTypes.StringType)
          .add("old_json", DataTypes.StringType)
          .add("ingest_ts", DataTypes.TimestampType)
          .add("batch_id", DataTypes.LongType)
          .add("event_id", DataTypes.StringType)
          .add("event_time", DataTypes.TimestampType)
          .add("depth", DataTypes.IntegerType)
          .add("source", DataTypes.StringType)
          .add("producer", DataTypes.StringType);

  /**
   * {@link #SCHEMA} and {@code new}/{@code old} as VARIANT, parsed here from the JSON text as
   * {@code parse_json} would: with option {@code variants} = {@code true}.
   */
  public static final StructType VARIANT_SCHEMA =
      SCHEMA.add("new", DataTypes.VariantType).add("old", DataTypes.VariantType);

  public InboxSource() {}

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return SCHEMA;
  }

  @Override
  public Table getTable(
      StructType schema, Transform[] partitioning, Map<String, String> properties) {
    return new InboxTable(new CaseInsensitiveStringMap(properties));
  }
}
