package eventplane.inbox;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonLocation;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonProcessingException;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import org.apache.spark.types.variant.Variant;
import org.apache.spark.types.variant.VariantBuilder;

/**
 * The CDC writers' JSON parsing of a payload ({@code new} or {@code old}): the producer's JSON
 * text, as bytes, into a VARIANT, with Spark's own {@link VariantBuilder} and the session's {@code
 * parse_json} settings. The raw inbox's reader parses every payload here ({@link InboxReader}), and
 * the daemon's tests ask {@link #checkMany} which documents the writers refuse, to prove that
 * ingest refuses exactly those (tests/ingest/test_payload_differential.py).
 */
public final class JsonCheck {
  // As Spark's parse_json: a factory with Jackson's defaults, shared (it is thread-safe).
  private static final JsonFactory JSON = new JsonFactory();

  private JsonCheck() {}

  /** {@code buf[offset, offset + length)} parsed as one JSON value into a VARIANT. */
  static Variant parse(
      byte[] buf, int offset, int length, boolean allowDuplicateKeys, boolean validateUnicode)
      throws IOException {
    try (JsonParser parser = JSON.createParser(buf, offset, length)) {
      parser.nextToken();
      return VariantBuilder.parseJson(parser, allowDuplicateKeys, validateUnicode);
    }
  }

  /**
   * One line for a parse failure: the exception's class, its message without Jackson's source
   * excerpt, and where in the value it stopped ({@code at byte N}, from 0).
   */
  static String describe(Throwable e) {
    String message;
    String where = "";
    if (e instanceof JsonProcessingException jpe) {
      message = jpe.getOriginalMessage();
      JsonLocation at = jpe.getLocation();
      if (at != null && at.getByteOffset() >= 0) {
        where = " at byte " + at.getByteOffset();
      }
    } else {
      message = String.valueOf(e.getMessage());
    }
    return e.getClass().getSimpleName() + ": " + message.split("\n", 2)[0] + where;
  }

  /**
   * For each document of {@code data} (one after another, {@code lengths} their byte lengths,
   * comma-separated), null when the writers take it, else the writers' error as {@code Class:
   * message}. One call for many documents: a py4j round trip costs more than a parse.
   */
  public static String[] checkMany(
      byte[] data, String lengths, boolean allowDuplicateKeys, boolean validateUnicode) {
    String[] sizes = lengths.isEmpty() ? new String[0] : lengths.split(",");
    String[] out = new String[sizes.length];
    int at = 0;
    for (int i = 0; i < sizes.length; i++) {
      int n = Integer.parseInt(sizes[i]);
      try {
        parse(data, at, n, allowDuplicateKeys, validateUnicode);
      } catch (IOException | RuntimeException | StackOverflowError e) {
        out[i] = describe(e);
      }
      at += n;
    }
    return out;
  }

  /** {@link #checkMany} for one document given as text (UTF-8). */
  public static String check(String doc, boolean allowDuplicateKeys, boolean validateUnicode) {
    byte[] bytes = doc.getBytes(StandardCharsets.UTF_8);
    return checkMany(bytes, Integer.toString(bytes.length), allowDuplicateKeys, validateUnicode)[0];
  }
}
