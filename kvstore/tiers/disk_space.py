"""The disk tier's checks of its files and filesystem.

- ``check_data_file``: lmdb maps ``data.mdb``; a page past the end of the file is a SIGBUS in the
  reading process (no Python exception). A file shorter than the pages its own metadata uses
  (a partial copy, a truncate) is refused at open instead. A file truncated while a process has
  it open cannot be caught: the next read of a missing page still ends that process.
- ``free_bytes``: bytes an unprivileged writer may still add to the filesystem of a path.
- ``RateLimitedLog``: one log line per interval for an error that repeats on every write.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from kvstore.units import format_size

DATA_FILE = "data.mdb"


class DiskFileTruncated(ValueError):
    """``data.mdb`` is shorter than the pages lmdb's metadata says it uses."""


class DiskShrinkRefused(ValueError):
    """The disk tier holds more than its (new) capacity and evicting at open was not allowed."""


def check_data_file(env, path: str) -> None:
    """Refuse an lmdb environment whose data file is shorter than its last used page.

    ``env``: an open ``lmdb.Environment`` (read-only or not) at directory ``path``. The size it
    needs is ``(env.info()['last_pgno'] + 1) * env.stat()['psize']`` bytes.

    Raises:
        DiskFileTruncated: naming the file, its size and the size its index needs.
    """
    data = os.path.join(path, DATA_FILE)
    last_pgno = env.info()["last_pgno"]
    need = (last_pgno + 1) * env.stat()["psize"]
    size = os.path.getsize(data)
    if size < need:
        raise DiskFileTruncated(
            f"{data} is {size} bytes ({format_size(size)}) but its lmdb index uses {need} bytes "
            f"({format_size(need)}, pages 0-{last_pgno}): the file is truncated (a partial copy?) "
            f"and reading it would crash the process; restore the file or remove the directory")


def free_bytes(path: str) -> int | None:
    """Bytes free to unprivileged writers on the filesystem holding ``path``
    (``statvfs``: ``f_bavail * f_frsize``); None when it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def data_file_bytes(path: str) -> int:
    """Size of ``path``'s ``data.mdb`` in bytes (0 when absent)."""
    try:
        return os.path.getsize(os.path.join(path, DATA_FILE))
    except OSError:
        return 0


#: Fraction of the room the filesystem has (the data file plus its free space) that the tier's
#: values may use: lmdb's B-tree, freelist and page rounding take the rest.
FS_ROOM_FRACTION = 0.9


def filesystem_cap(path: str, largest_value: int = 0) -> int | None:
    """Most value bytes the disk tier at ``path`` can hold on its filesystem now:
    ``FS_ROOM_FRACTION`` x (``data.mdb``'s size + the filesystem's free bytes), less two values
    of ``largest_value`` bytes (lmdb reuses the pages of a deleted value only two transactions
    later, so replacing one value needs room for two more); at least 0. None when the free
    space cannot be read."""
    free = free_bytes(path)
    if free is None:
        return None
    return max(0, int((data_file_bytes(path) + free) * FS_ROOM_FRACTION) - 2 * largest_value)


class RateLimitedLog:
    """Logs a repeated message at most once per ``interval_s`` seconds; the line that is
    logged says how many were left out since the previous one. Thread-safe.

    ``clock``: seconds (monotonic), for tests.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args) -> bool:
        """Log ``msg % args`` at ``level`` unless one was logged in the last ``interval_s``
        seconds (then count it). Returns whether it was logged."""
        with self._lock:
            now = self.clock()
            if self._last is not None and now - self._last < self.interval_s:
                self._held += 1
                return False
            held, self._held, self._last = self._held, 0, now
        if held:
            msg += f" ({held} more like it since the previous line, not logged)"
        self.logger.log(level, msg, *args)
        return True
