"""The daemon's CPU arena as the same-host client maps it (``Arena``: read-only, copied out of
by gets, lent as views by borrows) and the socket path of a ``unix://`` URL (``unix_path``).
Used by ``kvstore.daemon.shm_conn``'s connections.
"""
from __future__ import annotations

import mmap
import warnings
from typing import Sequence

import numpy as np

from kvstore.daemon.protocol import ProtocolError


def unix_path(url: str) -> str:
    """The socket path of ``unix:///PATH`` (or a bare absolute ``PATH``).

    Raises:
        ValueError: anything else (a relative path, a host part, an empty path).
    """
    want = f"malformed kvstore unix socket URL {url!r}: expected unix:///ABSOLUTE/PATH"
    if not isinstance(url, str):
        raise ValueError(want)
    path = url[len("unix://"):] if url.startswith("unix://") else url
    if not path.startswith("/") or "\0" in path:
        raise ValueError(want)
    return path


class Arena:
    """The daemon's CPU arena (a memfd) mapped read-only into this process.

    Attributes:
        instance: the daemon start it belongs to (``hello``'s ``instance``).
        nbytes: the arena's size in bytes (0: the daemon has no CPU tier; no mapping).
        array: ``np.uint8`` array ``[nbytes]`` over the mapping (not writable), or None.
    """

    def __init__(self, instance: str, fd: int | None, nbytes: int):
        self.instance, self.nbytes, self.array = instance, nbytes, None
        self._mm = self._tensor = None
        if nbytes:
            if fd is None:
                raise ProtocolError(f"hello announced an arena of {nbytes} bytes but passed "
                                    "no descriptor")
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self.array = np.frombuffer(self._mm, dtype=np.uint8)  # [nbytes], read-only

    def tensor(self):
        """A ``torch.uint8`` tensor ``[nbytes]`` over the read-only mapping (writing into it
        faults; torch's warning about non-writable arrays is silenced here only). Made once."""
        if self._tensor is None:
            import torch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def merged_runs(self, runs: Sequence, nbytes: int) -> list[list[int]]:
        """Arena byte runs ``[[offset, nbytes], ...]`` of one chunk of ``nbytes`` bytes,
        checked, with adjacent runs merged.

        Raises:
            ProtocolError: no arena, a malformed run, one outside the arena, or runs whose
                sizes do not add up to ``nbytes``.
        """
        if self.array is None:
            raise ProtocolError("a get answered with arena runs but the daemon has no arena")
        merged: list[list[int]] = []
        for r in runs:
            if not (isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                    and type(r[1]) is int and r[0] >= 0 and r[1] > 0
                    and r[0] + r[1] <= self.nbytes):
                raise ProtocolError(f"bad arena run {str(r)[:60]} (arena of {self.nbytes} "
                                    "bytes)")
            if merged and merged[-1][0] + merged[-1][1] == r[0]:
                merged[-1][1] += r[1]
            else:
                merged.append([r[0], r[1]])
        if sum(n for _, n in merged) != nbytes:
            raise ProtocolError(f"arena runs hold {sum(n for _, n in merged)} bytes; the chunk "
                                f"has {nbytes}")
        return merged

    def copy_runs(self, runs: Sequence, dst: np.ndarray) -> None:
        """Copy arena byte runs ``[[offset, nbytes], ...]`` into ``dst`` (``np.uint8`` of
        exactly their total size), adjacent runs merged into one copy.

        Raises:
            ProtocolError: as ``merged_runs``.
        """
        pos, src = 0, self.array
        for off, n in self.merged_runs(runs, dst.size):
            np.copyto(dst[pos:pos + n], src[off:off + n])
            pos += n
