package eventplane.inbox;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.text.SimpleDateFormat;
import java.time.LocalDate;
import java.util.ArrayList;
import java.util.Date;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.Callable;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.mapreduce.Job;
import org.apache.hadoop.mapreduce.JobID;
import org.apache.hadoop.mapreduce.TaskAttemptContext;
import org.apache.hadoop.mapreduce.TaskAttemptID;
import org.apache.hadoop.mapreduce.TaskID;
import org.apache.hadoop.mapreduce.TaskType;
import org.apache.hadoop.mapreduce.lib.output.FileOutputFormat;
import org.apache.hadoop.mapreduce.task.TaskAttemptContextImpl;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.ProjectingInternalRow;
import org.apache.spark.sql.catalyst.catalog.ExternalCatalogUtils;
import org.apache.spark.sql.execution.datasources.OutputWriter;
import org.apache.spark.sql.execution.datasources.OutputWriterFactory;
import org.apache.spark.sql.execution.datasources.parquet.ParquetFileFormat;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.unsafe.types.UTF8String;
import scala.collection.immutable.IndexedSeq;
import scala.jdk.javaapi.CollectionConverters;

/**
 * A batch's CDC write without a Spark job: the rows of a raw inbox file, read and parsed as the
 * inbox's Spark scan reads them, written by Spark's own Parquet writer into the partition folders
 * of the staging directory ({@code collection=X}, and {@code date=D} and {@code hour=H} below it
 * when the stream partitions by time).
 *
 * <p>A Spark job per batch costs the driver its analysis, planning, scheduling and commit: about
 * 75 ms of wall time and 90 ms of CPU on two cores, whatever the rows. For a batch of a few
 * thousand rows that is most of its run. This write does what the job's tasks do, one per split of
 * the file, in parallel (the reader's rows, the table's columns, a writer per partition folder),
 * with the same writer factory ({@link ParquetFileFormat#prepareWrite}), the same Hadoop
 * configuration (the session's, with the write's options) and the same file and folder names, so
 * its files are the job's files: the same rows in the same order, schema, footer and encodings.
 * The time partitions are computed as the daemon's job computes them ({@code
 * daemon.table.layout.time_columns}): the UTC day and hour of {@code ingest_ts}, from whole epoch
 * seconds.
 */
public final class DirectWrite {
  /** Threads for the splits after the first, which the calling thread writes. */
  private static final ExecutorService SPLITS =
      Executors.newCachedThreadPool(
          new java.util.concurrent.ThreadFactory() {
            private final AtomicInteger n = new AtomicInteger();

            @Override
            public Thread newThread(Runnable r) {
              Thread t = new Thread(r, "eventplane-direct-write-" + n.incrementAndGet());
              t.setDaemon(true);
              return t;
            }
          });

  private final SparkSession spark;
  private final String output;
  private final long batchId;
  private final StructType dataSchema;
  private final IndexedSeq<Object> ordinals;
  private final int collection;
  private final int lsn;
  private final int ingestTs;
  private final boolean byDate;
  private final boolean byHour;
  private final Set<UTF8String> wanted;
  private final RowFilter filter;
  private final Configuration conf;
  private final OutputWriterFactory factory;
  private final InboxReader.VariantOptions variants;
  private final String jobTracker;
  private final String uuid;
  /** Set when a task failed: the others stop at their next chunk. */
  private final AtomicBoolean abort = new AtomicBoolean();

  private DirectWrite(
      SparkSession spark,
      String output,
      long batchId,
      Map<String, String> options,
      String[] columns,
      String[] collections,
      String[] partitionBy,
      long[] skip) {
    String layout = String.join(",", partitionBy);
    byDate = layout.startsWith("collection,date");
    byHour = layout.equals("collection,date,hour");
    if (!byHour && !layout.equals("collection,date") && !layout.equals("collection")) {
      throw new IllegalArgumentException("eventplane direct write: partitions " + layout);
    }
    this.spark = spark;
    this.output = output;
    this.batchId = batchId;
    StructType in = InboxSource.VARIANT_SCHEMA;
    collection = in.fieldIndex("collection");
    lsn = in.fieldIndex("lsn");
    ingestTs = in.fieldIndex("ingest_ts");
    List<StructField> fields = new ArrayList<>();
    List<Object> taken = new ArrayList<>();
    for (String name : columns) {
      if (!name.equals("collection")) {
        int i = in.fieldIndex(name);
        fields.add(in.fields()[i]);
        taken.add(i);
      }
    }
    dataSchema = new StructType(fields.toArray(new StructField[0]));
    ordinals = CollectionConverters.asScala(taken).toIndexedSeq();
    wanted = new HashSet<>();
    for (String c : collections) {
      wanted.add(UTF8String.fromString(c));
    }
    filter = RowFilter.of(collections, skip);
    scala.collection.immutable.Map<String, String> scalaOptions =
        scala.collection.immutable.Map.from(CollectionConverters.asScala(options));
    Job job;
    try {
      job = Job.getInstance(spark.sessionState().newHadoopConfWithOptions(scalaOptions));
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    job.setOutputKeyClass(Void.class);
    job.setOutputValueClass(InternalRow.class);
    FileOutputFormat.setOutputPath(job, new Path(output));
    factory = new ParquetFileFormat().prepareWrite(spark, job, scalaOptions, dataSchema);
    conf = job.getConfiguration();
    variants = InboxReader.VariantOptions.of(spark.sessionState().conf());
    jobTracker = new SimpleDateFormat("yyyyMMddHHmmss", Locale.US).format(new Date());
    uuid = UUID.randomUUID().toString();
  }

  /**
   * Write the rows of {@code inbox}'s {@code splits} whose collection is in {@code collections}
   * (empty: all) into {@code output}, columns {@code columns} (the table's), in the folders of
   * {@code partitionBy}: {@code collection}, then optionally {@code date}, then optionally {@code
   * hour}. One task per split, as a job's; all of them have ended when this returns or throws.
   * Returns the rows written. On failure the files written so far stay: the caller removes the
   * staging folder.
   */
  public static long write(
      SparkSession spark,
      String inbox,
      String splits,
      long batchId,
      String output,
      Map<String, String> options,
      String[] columns,
      String[] collections,
      String[] partitionBy)
      throws Exception {
    return write(
        spark, inbox, splits, batchId, output, options, columns, collections, partitionBy,
        new long[0]);
  }

  /**
   * {@link #write}, leaving out the rows whose LSN is in {@code skip} (a stream's quarantined
   * rows): their payloads are not parsed.
   */
  public static long write(
      SparkSession spark,
      String inbox,
      String splits,
      long batchId,
      String output,
      Map<String, String> options,
      String[] columns,
      String[] collections,
      String[] partitionBy,
      long[] skip)
      throws Exception {
    // A job would fail on a stopped context, and the daemon then rebuilds the session; so
    // does this write, which would otherwise go on without one.
    if (spark.sparkContext().isStopped()) {
      throw new IllegalStateException(
          "eventplane direct write: Cannot call methods on a stopped SparkContext");
    }
    DirectWrite plan =
        new DirectWrite(
            spark, output, batchId, options, columns, collections, partitionBy, skip);
    List<InboxPartition> parts = InboxTable.partitions(inbox, splits);
    List<Future<Long>> others = new ArrayList<>();
    for (int k = 1; k < parts.size(); k++) {
      others.add(SPLITS.submit(plan.task(k, parts.get(k))));
    }
    long rows = 0;
    Exception failed = null;
    try {
      rows += parts.isEmpty() ? 0 : plan.task(0, parts.get(0)).call();
    } catch (Exception e) {
      failed = e;
      plan.abort.set(true);
    }
    // Every task ends before this returns (get waits): none may write into a staging folder
    // the caller removes after a failure. The first failure is the one reported.
    for (Future<Long> f : others) {
      try {
        rows += f.get();
      } catch (ExecutionException e) {
        plan.abort.set(true);
        if (failed == null) {
          failed = e.getCause() instanceof Exception ex ? ex : new RuntimeException(e.getCause());
        }
      }
    }
    if (failed != null) {
      throw failed;
    }
    return rows;
  }

  /**
   * The rows of {@code inbox}'s {@code splits} whose collection is in {@code collections} (empty:
   * all) and whose payload cannot be parsed on its own, each as {@code "lsn<TAB>field: error"},
   * in file order, at most {@code limit} of them (one more tells the caller there are more). A
   * stream asks this after its write failed: a row listed here fails every write that takes it (a
   * bad row); an empty answer means the failure was not any one row's (a bad moment). Reads the
   * file once, in this thread, with the session's parse_json settings.
   */
  public static String[] badRows(
      SparkSession spark,
      String inbox,
      String splits,
      long batchId,
      String[] collections,
      int limit)
      throws IOException {
    InboxReader.VariantOptions variants =
        InboxReader.VariantOptions.of(spark.sessionState().conf());
    RowFilter filter = RowFilter.of(collections, new long[0]);
    List<String> bad = new ArrayList<>();
    for (InboxPartition split : InboxTable.partitions(inbox, splits)) {
      try (InboxReader reader =
          new InboxReader(
              split.path(), split.offset(), split.length(), batchId, variants, filter, bad)) {
        while (bad.size() <= limit && reader.next()) {
          // Each chunk's rows are decoded; the unparseable ones were added to bad.
        }
      }
      if (bad.size() > limit) {
        break;
      }
    }
    return bad.subList(0, Math.min(bad.size(), limit + 1)).toArray(new String[0]);
  }

  /** The task of split {@code k}: its rows into its own files, {@code part-0000k-...}. */
  private Callable<Long> task(int k, InboxPartition split) {
    return () -> {
      boolean other = Thread.currentThread().getName().startsWith("eventplane-direct-write-");
      if (other) {
        SparkSession.setActiveSession(spark);
      }
      try {
        return writeSplit(k, split);
      } finally {
        if (other) {
          SparkSession.clearActiveSession();
        }
      }
    };
  }

  private long writeSplit(int k, InboxPartition split) throws IOException {
    TaskAttemptContext task = taskContext(new Configuration(conf), k);
    String name = String.format("part-%05d-%s.c000%s", k, uuid, factory.getFileExtension(task));
    ProjectingInternalRow projected = new ProjectingInternalRow(dataSchema, ordinals);
    Map<Folder, OutputWriter> writers = new HashMap<>();
    long rows = 0;
    try (InboxReader reader =
        new InboxReader(
            split.path(), split.offset(), split.length(), batchId, variants, filter, null)) {
      while (reader.next()) {
        if (abort.get()) {
          throw new IOException("eventplane direct write: stopped (another split failed)");
        }
        Iterator<InternalRow> it = reader.get().rowIterator();
        while (it.hasNext()) {
          InternalRow row = it.next();
          UTF8String value = row.getUTF8String(collection);
          if (!wanted.isEmpty() && !wanted.contains(value)) {
            continue;
          }
          if (filter.skips(row.getLong(lsn))) {
            continue;
          }
          long hour = Long.MIN_VALUE; // no time partition, or a NULL ingest_ts
          if (byDate && !row.isNullAt(ingestTs)) {
            hour = Math.floorDiv(Math.floorDiv(row.getLong(ingestTs), 1_000_000L), 3_600L);
            if (!byHour) {
              hour = Math.floorDiv(hour, 24L) * 24L; // one folder per day
            }
          }
          Folder key = new Folder(value, hour);
          OutputWriter writer = writers.get(key);
          if (writer == null) {
            String folder = key.path(byDate, byHour);
            writer = factory.newInstance(output + "/" + folder + "/" + name, dataSchema, task);
            writers.put(new Folder(value.clone(), hour), writer);
          }
          projected.project(row);
          writer.write(projected);
          rows++;
        }
      }
    } finally {
      IOException failed = null;
      for (OutputWriter writer : writers.values()) {
        try {
          writer.close();
        } catch (RuntimeException e) {
          if (failed == null) {
            failed = new IOException("eventplane direct write: closing a Parquet file failed", e);
          }
        }
      }
      if (failed != null) {
        throw failed;
      }
    }
    return rows;
  }

  /** A partition folder: the collection and the first epoch hour of its time partition. */
  private record Folder(UTF8String collection, long hour) {
    String path(boolean byDate, boolean byHour) {
      String out = ExternalCatalogUtils.getPartitionPathString("collection", collection.toString());
      if (byDate) {
        // NULL ingest_ts: Spark's write puts the row under the default partition name.
        boolean known = hour != Long.MIN_VALUE;
        String day = known ? LocalDate.ofEpochDay(Math.floorDiv(hour, 24L)).toString() : null;
        out += "/" + ExternalCatalogUtils.getPartitionPathString("date", day);
        if (byHour) {
          String hh = known ? String.format("%02d", Math.floorMod(hour, 24L)) : null;
          out += "/" + ExternalCatalogUtils.getPartitionPathString("hour", hh);
        }
      }
      return out;
    }
  }

  /** The attempt context of task {@code k}, as Spark's file writer sets one up. */
  private TaskAttemptContext taskContext(Configuration conf, int k) {
    JobID jobId = new JobID(jobTracker, 0);
    TaskAttemptID attempt = new TaskAttemptID(new TaskID(jobId, TaskType.MAP, k), 0);
    conf.set("mapreduce.job.id", jobId.toString());
    conf.set("mapreduce.task.id", attempt.getTaskID().toString());
    conf.set("mapreduce.task.attempt.id", attempt.toString());
    conf.setBoolean("mapreduce.task.ismap", true);
    conf.setInt("mapreduce.task.partition", 0);
    return new TaskAttemptContextImpl(conf, attempt);
  }
}
