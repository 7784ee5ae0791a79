package eventplane.hadoop;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;

/**
 * Trims a Hadoop configuration of defaults a local Spark never reads.
 *
 * <p>Hadoop's MapReduce classes (loaded by every Spark write) add {@code yarn-default.xml}
 * to every configuration: 527 of the session's 1,100 entries with a local master. Each Spark
 * job serialises the whole configuration to its tasks, one gzip stream per entry, and each
 * Parquet writer scans it for per-column options (docs/performance.md, "The fixed cost of a
 * batch").
 */
public final class HadoopDefaults {
  private HadoopDefaults() {}

  /**
   * Unset every key of {@code conf} whose only source is {@code resource} (a key a site file
   * or a program set stays), other than deprecated names, which Hadoop maps to others.
   *
   * @return how many keys were unset
   */
  public static int drop(Configuration conf, String resource) {
    List<String> keys = new ArrayList<>();
    for (Map.Entry<String, String> e : conf) {
      String key = e.getKey();
      String[] sources = conf.getPropertySources(key);
      if (sources != null
          && sources.length == 1
          && resource.equals(sources[0])
          && !Configuration.isDeprecated(key)) {
        keys.add(key);
      }
    }
    for (String key : keys) {
      conf.unset(key);
    }
    return keys.size();
  }
}
