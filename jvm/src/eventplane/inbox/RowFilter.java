package eventplane.inbox;

import java.io.Serializable;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.HashSet;
import java.util.Set;

/**
 * Which rows of an inbox a CDC stream takes: those of its collections (none listed: all), less
 * the LSNs it set aside (its quarantine). The reader parses the payloads of these rows only, so
 * a payload that cannot be parsed fails only the streams that take its row.
 *
 * <p>As data source options ({@link InboxTable}): {@code collections}, the names joined by
 * {@link #SEPARATOR}, and {@code skip_lsns}, decimal LSNs joined by commas.
 */
final class RowFilter implements Serializable {
  private static final long serialVersionUID = 1L;
  /** The ASCII unit separator; the daemon refuses to pass a name that holds it. */
  static final String SEPARATOR = "\u001f";

  static final RowFilter ALL = new RowFilter(null, new long[0]);

  private final Set<String> collections; // null: every collection
  private final long[] skip; // sorted

  private RowFilter(Set<String> collections, long[] skip) {
    this.collections = collections;
    this.skip = skip;
  }

  static RowFilter of(String[] collections, long[] skip) {
    Set<String> names = null;
    if (collections != null && collections.length > 0) {
      names = new HashSet<>(Arrays.asList(collections));
    }
    long[] sorted = skip == null ? new long[0] : skip.clone();
    Arrays.sort(sorted);
    return new RowFilter(names, sorted);
  }

  /** From the data source options (absent: every row). */
  static RowFilter fromOptions(String collections, String skipLsns) {
    String[] names = collections == null || collections.isEmpty()
        ? null : collections.split(SEPARATOR, -1);
    long[] skip = new long[0];
    if (skipLsns != null && !skipLsns.isEmpty()) {
      skip = Arrays.stream(skipLsns.split(",")).mapToLong(Long::parseLong).toArray();
    }
    return of(names, skip);
  }

  boolean everything() {
    return collections == null && skip.length == 0;
  }

  /** Whether the row of {@code lsn} whose collection is {@code buf[at, at + length)} is taken. */
  boolean takes(long lsn, byte[] buf, int at, int length) {
    if (skip.length > 0 && Arrays.binarySearch(skip, lsn) >= 0) {
      return false;
    }
    return collections == null
        || collections.contains(new String(buf, at, length, StandardCharsets.UTF_8));
  }

  boolean skips(long lsn) {
    return skip.length > 0 && Arrays.binarySearch(skip, lsn) >= 0;
  }
}
