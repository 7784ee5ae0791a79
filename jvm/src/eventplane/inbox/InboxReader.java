package eventplane.inbox;

import java.io.EOFException;
import java.io.IOException;
import java.io.Serializable;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.channels.FileChannel;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.util.List;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.internal.SQLConf;
import org.apache.spark.sql.types.VariantType;
import org.apache.spark.sql.vectorized.ColumnarBatch;
import org.apache.spark.types.variant.Variant;

/**
 * Reads one split of a raw inbox file, a chunk per columnar batch.
 *
 * <p>A chunk is one core's events in LSN order, written by {@code daemon/spark/rawinbox.py}. All
 * integers are little-endian:
 *
 * <pre>
 *   u32 magic "EPC1"   u32 count n   u32 core   u32 flags (0)   u64 reserved (0)   u64 data_len
 *   u64 lsn[n]         u64 seq[n]    u64 offset[n + 1]          data[data_len]
 * </pre>
 *
 * <p>Event {@code i}'s payload is {@code data[offset[i] - offset[0], offset[i + 1] - offset[0])}:
 * a msgpack array, the daemon's stored event ({@code daemon/events.py}): collection, op, key,
 * new and old (the producer's JSON text, or nil), ingest time in ns, depth, source, and in the
 * long form event id and event time in µs (or nil).
 *
 * <p>With {@link VariantOptions}, {@code new} and {@code old} are also parsed into VARIANT columns,
 * with Spark's own {@link VariantBuilder} and the session's {@code parse_json} settings, but
 * from the payload's bytes: {@code parse_json} over the text column first decodes each value
 * into a Java string and parses its characters.
 *
 * <p>A payload that is not such an array, or that does not end where the next one starts, fails
 * the task with the file, the chunk's offset, the event's index and LSN: the WAL checked every
 * payload's checksum before the daemon wrote it here, so this is a bug, never bad input.
 */
final class InboxReader implements PartitionReader<ColumnarBatch> {
  static final int MAGIC = 0x31435045; // "EPC1", little-endian
  static final int HEADER = 32;
  private static final int MAX_ROWS = 1 << 20;

  // Column positions in InboxSource.SCHEMA.
  private static final int LSN = 0, CORE = 1, SEQ = 2, COLLECTION = 3, OP = 4, KEY = 5;
  private static final int NEW = 6, OLD = 7, INGEST_TS = 8, BATCH_ID = 9, EVENT_ID = 10;
  private static final int EVENT_TIME = 11, DEPTH = 12, SOURCE = 13, PRODUCER = 14;
  private static final int NEW_VARIANT = 15, OLD_VARIANT = 16;

  /** The session's parse_json settings, read on the driver. */
  record VariantOptions(boolean allowDuplicateKeys, boolean validateUnicode)
      implements Serializable {
    /** The settings of {@code conf}, as parse_json reads them when it is planned. */
    static VariantOptions of(SQLConf conf) {
      return new VariantOptions(
          (Boolean) conf.getConf(SQLConf.VARIANT_ALLOW_DUPLICATE_KEYS()),
          (Boolean) conf.getConf(SQLConf.VARIANT_VALIDATE_UNICODE_IN_JSON_PARSING()));
    }
  }

  private final String path;
  private final FileChannel channel;
  private final long end;
  private final long batchId;
  private final VariantOptions variants; // null: no VARIANT columns
  private final RowFilter filter; // whose payloads are parsed; the others' VARIANTs are NULL
  // Null: a payload that cannot be parsed fails the read. Else its row's VARIANTs are NULL and
  // "lsn<TAB>error" is added here (DirectWrite.badRows).
  private final List<String> rowErrors;
  private final OnHeapColumnVector[] columns;
  private final ColumnarBatch batch;
  private final ByteBuffer header = ByteBuffer.allocate(HEADER).order(ByteOrder.LITTLE_ENDIAN);
  private long position;
  private byte[] buf = new byte[1 << 16];
  // The msgpack cursor, and the value the last integer() read.
  private int at;
  private long value;
  // Where an error is: the current chunk and event.
  private long chunkAt;
  private int event;
  private long eventLsn;
  // Where the last string() value lies in buf; -1 for nil.
  private int valueAt;
  private int valueLength;

  InboxReader(String path, long offset, long length, long batchId, VariantOptions variants)
      throws IOException {
    this(path, offset, length, batchId, variants, RowFilter.ALL, null);
  }

  InboxReader(
      String path,
      long offset,
      long length,
      long batchId,
      VariantOptions variants,
      RowFilter filter,
      List<String> rowErrors)
      throws IOException {
    this.path = path;
    this.variants = variants;
    this.filter = filter;
    this.rowErrors = rowErrors;
    this.channel = FileChannel.open(Path.of(path), StandardOpenOption.READ);
    this.position = offset;
    this.end = offset + length;
    this.batchId = batchId;
    this.columns =
        OnHeapColumnVector.allocateColumns(
            4096, variants == null ? InboxSource.SCHEMA : InboxSource.VARIANT_SCHEMA);
    this.batch = new ColumnarBatch(columns);
  }

  @Override
  public boolean next() throws IOException {
    if (position >= end) {
      return false;
    }
    chunkAt = position;
    event = -1;
    header.clear();
    readFully(header, position);
    header.flip();
    if (header.getInt(0) != MAGIC) {
      throw error("not a chunk (bad magic)");
    }
    int n = header.getInt(4);
    int core = header.getInt(8);
    int flags = header.getInt(12);
    long dataLen = header.getLong(24);
    if (n <= 0 || n > MAX_ROWS || dataLen < 0 || flags != 0) {
      throw error("bad chunk header (" + n + " events, " + dataLen + " bytes, flags " + flags + ")");
    }
    long arrays = 8L * n * 2 + 8L * (n + 1);
    long size = HEADER + arrays + dataLen;
    if (position + size > end || arrays + dataLen > Integer.MAX_VALUE - 16) {
      throw error("chunk of " + size + " bytes runs past its split");
    }
    int body = (int) (arrays + dataLen);
    if (buf.length < body) {
      buf = new byte[Math.max(body, buf.length * 2)];
    }
    readFully(ByteBuffer.wrap(buf, 0, body), position + HEADER);
    decode(n, core, (int) dataLen);
    position += size;
    return true;
  }

  @Override
  public ColumnarBatch get() {
    return batch;
  }

  @Override
  public void close() throws IOException {
    batch.close();
    channel.close();
  }

  private void readFully(ByteBuffer into, long from) throws IOException {
    long at = from;
    while (into.hasRemaining()) {
      int got = channel.read(into, at);
      if (got < 0) {
        throw new EOFException("eventplane inbox " + path + ": ends inside the chunk at " + chunkAt);
      }
      at += got;
    }
  }

  private void decode(int n, int core, int dataLen) throws IOException {
    for (OnHeapColumnVector c : columns) {
      c.reset();
      c.reserve(n);
      if (c.dataType() instanceof VariantType) {
        c.getChild(0).reserve(n); // value
        c.getChild(1).reserve(n); // metadata
      }
    }
    ByteBuffer le = ByteBuffer.wrap(buf).order(ByteOrder.LITTLE_ENDIAN);
    int lsnAt = 0;
    int offAt = 16 * n;
    int dataAt = offAt + 8 * (n + 1);
    columns[LSN].putLongsLittleEndian(0, n, buf, lsnAt);
    columns[SEQ].putLongsLittleEndian(0, n, buf, 8 * n);
    columns[CORE].putInts(0, n, core);
    columns[BATCH_ID].putLongs(0, n, batchId);
    long base = le.getLong(offAt);
    if (le.getLong(offAt + 8 * n) - base != dataLen) {
      throw error("the offsets do not span the chunk's " + dataLen + " data bytes");
    }
    long next = base;
    for (int i = 0; i < n; i++) {
      event = i;
      eventLsn = le.getLong(lsnAt + 8 * i);
      long from = next;
      next = le.getLong(offAt + 8 * (i + 1));
      if (next < from || next - base > dataLen) {
        throw error("offsets out of order or out of bounds");
      }
      at = dataAt + (int) (from - base);
      int stop = dataAt + (int) (next - base);
      try {
        row(i, stop);
      } catch (ArrayIndexOutOfBoundsException e) {
        throw error("payload ends inside a field");
      }
    }
    event = -1;
    batch.setNumRows(n);
  }

  /** Event {@code i}'s payload, {@code buf[at, stop)}, into row {@code i}. */
  private void row(int i, int stop) throws IOException {
    int b = buf[at++] & 0xff;
    int fields;
    if (b >= 0x90 && b <= 0x9f) {
      fields = b & 0x0f;
    } else {
      throw error("payload is not a msgpack array (type byte 0x" + Integer.toHexString(b) + ")");
    }
    if (fields != 8 && fields != 10 && fields != 11) {
      throw error("stored event has " + fields + " fields (8, 10 or 11 expected)");
    }
    string(COLLECTION, i, false);
    boolean parse =
        variants != null
            && (filter.everything() || filter.takes(eventLsn, buf, valueAt, valueLength));
    string(OP, i, false);
    string(KEY, i, false);
    string(NEW, i, true);
    int newAt = valueAt, newLength = valueLength;
    string(OLD, i, true);
    if (parse) {
      int oldAt = valueAt, oldLength = valueLength;
      valueAt = newAt;
      valueLength = newLength;
      boolean parsed = variant(NEW_VARIANT, i);
      valueAt = oldAt;
      valueLength = oldLength;
      if (parsed) {
        parsed = variant(OLD_VARIANT, i);
      }
      if (!parsed) {
        columns[NEW_VARIANT].putNull(i);
        columns[OLD_VARIANT].putNull(i);
      }
    } else if (variants != null) {
      columns[NEW_VARIANT].putNull(i);
      columns[OLD_VARIANT].putNull(i);
    }
    integer(false);
    columns[INGEST_TS].putLong(i, value / 1000);
    integer(false);
    columns[DEPTH].putInt(i, (int) value);
    string(SOURCE, i, false);
    if (fields >= 10) {
      string(EVENT_ID, i, true);
      if (integer(true)) {
        columns[EVENT_TIME].putLong(i, value);
      } else {
        columns[EVENT_TIME].putNull(i);
      }
    } else {
      columns[EVENT_ID].putNull(i);
      columns[EVENT_TIME].putNull(i);
    }
    if (fields == 11) {
      string(PRODUCER, i, true);
    } else {
      columns[PRODUCER].putNull(i);
    }
    if (at != stop) {
      throw error(
          at < stop
              ? "payload has " + (stop - at) + " bytes after its last field"
              : "payload runs " + (at - stop) + " bytes into the next one");
    }
  }

  /** A str or bin value (or nil, when {@code nullable}) into column {@code c}, row {@code i}. */
  private void string(int c, int i, boolean nullable) throws IOException {
    int b = buf[at++] & 0xff;
    int length;
    if (b >= 0xa0 && b <= 0xbf) {
      length = b & 0x1f;
    } else if (b == 0xd9 || b == 0xc4) {
      length = buf[at++] & 0xff;
    } else if (b == 0xda || b == 0xc5) {
      length = ((buf[at] & 0xff) << 8) | (buf[at + 1] & 0xff);
      at += 2;
    } else if (b == 0xdb || b == 0xc6) {
      length =
          ((buf[at] & 0xff) << 24)
              | ((buf[at + 1] & 0xff) << 16)
              | ((buf[at + 2] & 0xff) << 8)
              | (buf[at + 3] & 0xff);
      at += 4;
      if (length < 0) {
        throw error("string of more than 2 GiB");
      }
    } else if (b == 0xc0 && nullable) {
      columns[c].putNull(i);
      valueAt = -1;
      return;
    } else {
      throw error("field " + InboxSource.SCHEMA.fields()[c].name() + ": unexpected type byte 0x"
          + Integer.toHexString(b));
    }
    int from = at;
    at += length;
    if (at > buf.length) {
      throw new ArrayIndexOutOfBoundsException(at);
    }
    columns[c].putByteArray(i, buf, from, length);
    valueAt = from;
    valueLength = length;
  }

  /**
   * The JSON text string() just read (or nil) as a VARIANT into column {@code c}, row {@code i};
   * false when it cannot be parsed and the reader collects such rows ({@link #rowErrors}).
   */
  private boolean variant(int c, int i) throws IOException {
    WritableColumnVector column = columns[c];
    if (valueAt < 0) {
      column.putNull(i);
      return true;
    }
    Variant v;
    try {
      v =
          JsonCheck.parse(
              buf,
              valueAt,
              valueLength,
              variants.allowDuplicateKeys(),
              variants.validateUnicode());
    } catch (IOException | RuntimeException e) {
      String what = JsonCheck.describe(e);
      String field = InboxSource.VARIANT_SCHEMA.fields()[c].name();
      if (rowErrors != null) {
        rowErrors.add(eventLsn + "\t" + field + ": " + what);
        return false;
      }
      throw error("field " + field + ": not a VARIANT: " + what);
    }
    column.getChild(0).putByteArray(i, v.getValue());
    column.getChild(1).putByteArray(i, v.getMetadata());
    return true;
  }

  /** An integer into {@link #value}; false for nil (when {@code nullable}). */
  private boolean integer(boolean nullable) throws IOException {
    int b = buf[at++] & 0xff;
    if (b <= 0x7f) {
      value = b;
    } else if (b >= 0xe0) {
      value = b - 0x100;
    } else if (b == 0xc0 && nullable) {
      return false;
    } else {
      int width;
      switch (b) {
        case 0xcc, 0xd0 -> width = 1;
        case 0xcd, 0xd1 -> width = 2;
        case 0xce, 0xd2 -> width = 4;
        case 0xcf, 0xd3 -> width = 8;
        default -> throw error("unexpected integer type byte 0x" + Integer.toHexString(b));
      }
      long v = 0;
      for (int k = 0; k < width; k++) {
        v = (v << 8) | (buf[at + k] & 0xff);
      }
      at += width;
      if (b >= 0xd0 && width < 8) { // signed: extend the sign bit
        int shift = 64 - 8 * width;
        v = (v << shift) >> shift;
      }
      value = v;
    }
    return true;
  }

  private IOException error(String what) {
    String where = "eventplane inbox " + path + ": chunk at byte " + chunkAt;
    if (event >= 0) {
      where += ", event " + event + " (lsn " + eventLsn + ")";
    }
    return new IOException(where + ": " + what);
  }
}
