package eventplane.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's plain local file system, setting permissions in this process.
 *
 * <p>Without Hadoop's native library (pyspark ships none), {@link RawLocalFileSystem} sets
 * the permission of every folder it creates and every file it opens for writing by forking
 * a {@code chmod} process: nine per one-task CDC batch into four collections, about 2.3 ms
 * of CPU each (docs/performance.md, "The fixed cost of a batch"). This class sets the same
 * mode bits through {@code java.nio} instead. A mode with bits nio cannot express (sticky,
 * setuid, setgid), or a file system without POSIX attributes, goes to Hadoop's own method.
 *
 * <p>The daemon names this class in {@code fs.file.impl} for its staging writes only, and
 * only when it can load it (docs/cdc.md, "Step 1's file system").
 */
public class NioLocalFileSystem extends RawLocalFileSystem {
  // Bit i of a POSIX mode (0 = others' execute ... 8 = owner's read).
  private static final PosixFilePermission[] BITS = {
    PosixFilePermission.OTHERS_EXECUTE,
    PosixFilePermission.OTHERS_WRITE,
    PosixFilePermission.OTHERS_READ,
    PosixFilePermission.GROUP_EXECUTE,
    PosixFilePermission.GROUP_WRITE,
    PosixFilePermission.GROUP_READ,
    PosixFilePermission.OWNER_EXECUTE,
    PosixFilePermission.OWNER_WRITE,
    PosixFilePermission.OWNER_READ,
  };

  @Override
  public void setPermission(Path p, FsPermission permission) throws IOException {
    int mode = permission.toShort() & 07777;
    if ((mode & ~0777) != 0) {
      super.setPermission(p, permission);
      return;
    }
    Set<PosixFilePermission> perms = EnumSet.noneOf(PosixFilePermission.class);
    for (int i = 0; i < BITS.length; i++) {
      if ((mode & (1 << i)) != 0) {
        perms.add(BITS[i]);
      }
    }
    try {
      // Follows a symbolic link, as chmod does.
      Files.setPosixFilePermissions(pathToFile(p).toPath(), perms);
    } catch (UnsupportedOperationException e) {
      super.setPermission(p, permission);
    }
  }
}
