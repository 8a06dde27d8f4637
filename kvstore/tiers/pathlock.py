"""One process per disk path: an exclusive ``flock`` on ``<path>/kvstore.lock``.

Two processes writing one lmdb directory each keep their own index of it: when one removes or
evicts a chunk, the other still lists it (its lookups report hits that its reads cannot serve)
and the two evict by different policies. So a disk tier takes an exclusive, non-blocking
``fcntl.flock`` on a lock file in its directory when it opens and holds it until it closes;
the holder's pid is written into the file so that a refused opener can name it. ``flock``
locks belong to an open file description, so a second tier in the *same* process is refused
too, and the kernel drops the lock when the holder exits (even by SIGKILL): there is no stale
lock to clean up.

Read-only viewers (``kvstore inspect``) do not take this lock: they read lmdb in read-only
transactions, which lmdb's own reader table makes safe next to a writer in another process.
"""
from __future__ import annotations

import fcntl
import os

#: Name of the lock file inside a disk tier's directory.
LOCK_NAME = "kvstore.lock"


class DiskPathInUse(OSError, ValueError):
    """The disk path is held by another open disk tier (another process, or this one). An
    ``OSError`` and a ``ValueError``, so that command lines reporting either as a bad flag
    (``kvstore serve``, ``engine_min serve --kvstore-disk-path``) name the path and holder.

    Attributes:
        path: the disk tier's directory.
        pid: the holder's process id as written in the lock file (None if unreadable).
    """

    def __init__(self, path: str, pid: int | None) -> None:
        who = "an unknown process" if pid is None else f"process {pid}"
        if pid == os.getpid():
            who += " (this process: another store on the same path is still open)"
        super().__init__(
            f"disk path {os.path.abspath(path)!r} is in use by {who} (lock file "
            f"{os.path.join(os.path.abspath(path), LOCK_NAME)}); one kvstore process per disk "
            f"path: stop that process or choose another disk path (`kvstore inspect PATH` "
            f"reads a path in use, read-only)")
        self.path, self.pid = path, pid


def holder_pid(path: str) -> int | None:
    """The pid written in ``path``'s lock file (None: no file, empty or unreadable). The
    holder empties the file when it releases the lock, so a pid names the holder, or a holder
    that died without releasing (the kernel dropped its lock then)."""
    try:
        with open(os.path.join(path, LOCK_NAME)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class PathLock:
    """Exclusive lock of a disk tier's directory, held until ``release``.

    Args:
        path: an existing directory.

    Raises:
        DiskPathInUse: another open lock holds ``path`` (names the holder's pid).
        OSError: the lock file cannot be created or opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskPathInUse(path, holder_pid(path)) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the lock file (a pid in it means "held", unless that process died) and drop
        the lock; the file stays. Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
