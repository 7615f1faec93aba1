"""The daemon's shared-memory arena: one sealed memfd that holds L1's bytes, and its extent allocator.

Who owns what:
  * The DAEMON makes the arena (``Arena.create``): an anonymous memfd (its pages are taken as they are
    first written, like any L1 memory; memfds live on the kernel's internal shm mount, which /dev/shm's
    size does not limit) sealed against shrinking and growing, so no process that opens it can truncate
    it under another's mapping (the SIGBUS a short file gives). It has
    no name in /dev/shm: a client maps it through ``/proc/<daemon pid>/fd/<fd>``, which the kernel opens
    only for the daemon's own user (ptrace access rules), and the daemon tells that pid and fd only to an
    authenticated client (``MapArena``). The memory goes away with the daemon and the last client mapping.
  * ``Arena`` allocates 64-byte aligned extents (first fit over a sorted free list, merged on free). It has
    no lock: ``ArenaTier`` (arena_tier.py) calls it under its own lock, and only from there.
  * The bytes of an extent belong to whoever ``ArenaTier`` says: a writing client between Reserve and
    Commit, else the tier (read by leasing clients, the daemon's zmq sends and the write-through thread
    while they hold a pin). ``ArenaMap`` is the client's mapping (``open``, ``write``, ``read``, ``close``).
    Every client that maps the arena can write all of it: it holds the cluster key, and is trusted as the
    seal is -- a slot changed by anyone but its writer fails its seal (checked by every loader), a miss.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import stat

import numpy as np
import torch

from pdserve.kvstore.shm import MappedBytes

ALIGN = 64
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A memfd of ``size`` bytes mapped by the daemon, with an extent allocator over it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.inode = os.fstat(fd).st_ino
        self._mm = mmap.mmap(fd, size)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)      # [size] uint8, the whole arena
        self.tensor = torch.from_numpy(self.buf)
        self._starts: list[int] = [0]            # free extents, sorted by start
        self._lens: dict[int, int] = {0: size}    # free extent start -> length
        self.free_bytes = size

    @classmethod
    def create(cls, size: int) -> "Arena":
        if size <= 0:
            raise ValueError(f"arena of {size} bytes; it must be > 0 (--kv-cpu-bytes)")
        size = align(size)
        fd = os.memfd_create("pdserve-kv-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
            return cls(fd, size)
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"cannot make a {size}-byte KV arena: {exc.strerror} (--kv-cpu-bytes)") from None

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free extent of ``align(nbytes)`` bytes, or None when no free extent is that long."""
        need = align(max(nbytes, 1))
        for start in self._starts:
            length = self._lens[start]
            if length >= need:
                self._starts.remove(start)
                del self._lens[start]
                if length > need:
                    self._insert(start + need, length - need)
                self.free_bytes -= need
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back an extent ``alloc`` returned (merged with its free neighbours)."""
        length = align(max(nbytes, 1))
        self.free_bytes += length
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + length == self._starts[i]:      # merge with the next
            nxt = self._starts.pop(i)
            length += self._lens.pop(nxt)
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == offset:   # and the previous
            prev = self._starts[i - 1]
            self._lens[prev] += length
            return
        self._insert(offset, length)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] view of the arena at ``offset`` (no copy)."""
        return self.tensor[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap once nothing refers to the arena's tensor any more (else the mapping goes with the process)."""
        self.tensor = self.buf = None
        try:
            self._mm.close()
        except BufferError:
            pass
        os.close(self.fd)

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lens[start] = length


class ArenaMap(MappedBytes):
    """A client's mapping of the daemon's arena (``gen`` names the arena; a restarted daemon has another); ``write``
    and ``read`` (the put's and the get's one copy) are ``shm.MappedBytes``'."""

    what = "arena"

    def __init__(self, mm: mmap.mmap, size: int, gen: int) -> None:
        self._mm, self.size, self.gen = mm, size, gen
        self.buf = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def open(cls, pid: int, fd: int, size: int, gen: int, inode: int) -> "ArenaMap":
        """Map fd ``fd`` of process ``pid`` (the daemon that proved it holds the key), if it is the sealed file of
        this user's of ``size`` bytes and inode ``inode`` the daemon named: nothing can truncate it under us, so
        no access to it can SIGBUS, and a pid that names another process here (another pid namespace) opens
        another file, which is refused."""
        if pid <= 0 or fd < 0:
            raise ValueError(f"arena names pid {pid}, fd {fd}")
        fd_here = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd_here)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size or st.st_ino != inode:
                raise ValueError(f"/proc/{pid}/fd/{fd} is not the daemon's {size}-byte arena, inode {inode} (uid "
                                 f"{st.st_uid}, {st.st_size} bytes, inode {st.st_ino})")
            if fcntl.fcntl(fd_here, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise ValueError(f"/proc/{pid}/fd/{fd} is not sealed against shrinking: not the daemon's arena")
            return cls(mmap.mmap(fd_here, size), size, gen)
        finally:
            os.close(fd_here)

    def close(self) -> None:
        if self.buf is not None:
            self.buf = None
            self._mm.close()

