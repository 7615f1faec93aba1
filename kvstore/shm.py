"""The shared-memory data plane for clients on the daemon's host.

Loopback TCP copies every byte through the kernel twice; a shared segment does not.
The DAEMON owns every segment: on ``Attach`` it creates /dev/shm/pdserve-kv-<hex>,
reserves its pages with posix_fallocate (a full /dev/shm is an error reply now, never a
SIGBUS later), maps it and replies with path, size and generation. The client opens that
path, checks its size, maps it and unlinks the name (the daemon unlinks it too when it
drops the segment); the daemon never maps a file a client made. Payloads sit at 64-byte
aligned offsets chosen by the writer of each message (client for Put, daemon for Get).

Who calls it: the daemon (``SegmentTable``: create, look up by client and generation,
drop, reclaim segments whose owner process is gone) and ``DaemonClient``
(``ShmSegment.open``, ``write``/``read``, ``close``).

Who may hold a segment (the kernel decides, not a claim in a message): only an authenticated client can
Attach (the daemon checks its token first), and a segment lives only while the process it was made for
maps it -- checked in that process's /proc/<pid>/maps by the segment's inode, after ``map_grace_s``. A
client that names another process (pid 1, say) gets a segment nobody maps, reclaimed within a few
seconds; the file is 0600 and the daemon's, so no other user can map it. All segments together stay
under ``max_total_bytes`` (default: half of /dev/shm's free space when the daemon starts): a new segment
past it is refused with a clear error (the client uses zmq frames) while live clients keep theirs.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import time
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^pdserve-kv-[0-9a-f]{8,64}$")
ALIGN = 64
MAP_GRACE_S = 10.0      # default: a new segment's owner has this long to map it before the maps check applies


class NoSegment(LookupError):
    """The daemon has no segment of the request's generation for this client (Attach again)."""


class MappedBytes:
    """Bounds-checked copies in and out of a mapping ``self.buf`` (a uint8 numpy view of ``self.size`` bytes): the
    one copy each way of a segment (``ShmSegment``) and of the daemon's arena (``arena.ArenaMap``)."""

    buf: np.ndarray | None
    size: int
    what = "segment"

    def write(self, offset: int, data) -> None:
        """Copy a tensor (or a uint8 buffer) to ``offset``."""
        if isinstance(data, torch.Tensor):
            data = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        src = np.frombuffer(data, dtype=np.uint8)
        self._check(offset, src.size)
        self.buf[offset:offset + src.size] = src

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor with a copy of ``nbytes`` at ``offset``."""
        self._check(offset, nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.numpy()[:] = self.buf[offset:offset + nbytes]
        return out

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the {self.size}-byte {self.what}")


class ShmSegment(MappedBytes):
    """One mapped segment; ``gen`` is the daemon's generation number for it."""

    def __init__(self, path: Path, size: int, gen: int, mm: mmap.mmap, inode: tuple[int, int] = (0, 0)) -> None:
        self.path, self.size, self.gen, self._mm = path, size, gen, mm
        self.inode = inode                    # (st_dev, st_ino): how /proc/<pid>/maps names it
        self.buf = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def create(cls, size: int, gen: int) -> "ShmSegment":
        """Daemon side: a new file whose pages are reserved before anyone maps it."""
        path = SHM_DIR / f"pdserve-kv-{secrets.token_hex(16)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            st = os.fstat(fd)
            return cls(path, size, gen, mmap.mmap(fd, size), (st.st_dev, st.st_ino))
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise OSError(exc.errno, f"cannot reserve a {size}-byte shm segment in {SHM_DIR}: {exc.strerror} "
                                     "(free /dev/shm or lower the client's shm_bytes)") from None
        finally:
            os.close(fd)

    @classmethod
    def open(cls, path: str, size: int, gen: int) -> "ShmSegment":
        """Client side: map the daemon's segment, check it, unlink the name. The path comes from whoever
        answered on the daemon's port: it must be a pdserve segment in /dev/shm, opened without following a link,
        a regular file of this user's (the daemon and its nodes run as one user) that no one else may open, of
        the size named -- never a file the answer points at."""
        p = Path(path)
        if p.parent != SHM_DIR or not _NAME.fullmatch(p.name):
            raise ValueError(f"shm path {path!r} is not a pdserve segment under {SHM_DIR}")
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_nlink != 1:
                raise ValueError(f"shm segment {path} is not a private file of this user's (uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} links)")
            if st.st_size != size:
                raise ValueError(f"shm segment {path} has {st.st_size} bytes, daemon says {size}")
            return cls(p, size, gen, mmap.mmap(fd, size))
        finally:
            os.close(fd)
            p.unlink(missing_ok=True)


    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.buf is not None:
            self.buf = None
            self._mm.close()



def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time, clock ticks); None if gone or a zombie.

    pid + start time names a process even after its pid is reused."""
    if pid <= 0:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()      # fields[0] is field 3 (state)
    return None if fields[0] in ("Z", "X") else int(fields[19])


def maps_inode(pid: int, inode: tuple[int, int]) -> bool:
    """Whether process ``pid`` maps the file ``inode`` = (st_dev, st_ino) (False if we may not look)."""
    dev = f"{os.major(inode[0]):02x}:{os.minor(inode[0]):02x}"
    want = f" {dev} {inode[1]} "
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(want in line for line in f)
    except OSError:
        return False


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class SegmentTable:
    """The daemon's segments by client identity, with owner pid, start time and creation time.

    ``attach`` reclaims segments of dead owners when at ``max_clients`` (or ``max_total_bytes``) and
    refuses a new client when every owner is alive: a live client's segment is never evicted."""

    def __init__(self, max_clients: int, max_bytes: int, max_total_bytes: int | None = None,
                 map_grace_s: float = MAP_GRACE_S) -> None:
        self.max_clients, self.max_bytes, self.map_grace_s = max_clients, max_bytes, map_grace_s
        self.max_total_bytes = shm_free_bytes() // 2 if max_total_bytes is None else max_total_bytes
        self._segs: dict[bytes, tuple[ShmSegment, int, int, float]] = {}   # ident -> (seg, pid, start, made)
        self._next_gen = secrets.randbits(48) + 1    # random start: a restarted daemon reuses none
        self.reclaimed = self.refused = 0

    def __len__(self) -> int:
        return len(self._segs)

    def attach(self, ident: bytes, pid: int, size: int) -> ShmSegment:
        if not 0 < size <= self.max_bytes:
            raise ValueError(f"shm segment of {size} bytes; limit is {self.max_bytes} (--kv-max-shm-bytes)")
        start = process_start_time(pid)
        if start is None:
            raise ValueError(f"pid {pid} is not a live process on the daemon's host (shm needs the same host)")
        self.drop(ident)
        if len(self._segs) >= self.max_clients and not self.reclaim_dead():
            self.refused += 1
            raise ValueError(f"{len(self._segs)} shm clients attached, all alive; limit is {self.max_clients} "
                             "(--kv-max-shm-clients); use zmq frames")
        if self.total_bytes + size > self.max_total_bytes:
            self.reclaim_dead()
        if self.total_bytes + size > self.max_total_bytes:
            self.refused += 1
            raise ValueError(f"{len(self._segs)} shm segments hold {self.total_bytes} bytes; another {size} would "
                             f"pass the limit of {self.max_total_bytes} (--kv-max-shm-total-bytes); use zmq frames")
        seg = ShmSegment.create(size, self._next_gen)
        self._next_gen += 1
        self._segs[ident] = (seg, pid, start, time.monotonic())
        return seg

    @property
    def total_bytes(self) -> int:
        return sum(entry[0].size for entry in self._segs.values())

    def get(self, ident: bytes, gen: int) -> ShmSegment:
        seg = self._segs.get(ident, (None,))[0]
        if seg is None or seg.gen != gen:
            have = f"generation {seg.gen}" if seg else "none"
            raise NoSegment(f"no shm segment of generation {gen} for this client (it has {have}); Attach again")
        return seg

    def drop(self, ident: bytes) -> None:
        entry = self._segs.pop(ident, None)
        if entry is not None:
            entry[0].unlink()
            entry[0].close()

    def reclaim_dead(self) -> int:
        """Drop the segments whose owner process is gone or, past its grace time, does not map it; how many."""
        now = time.monotonic()
        dead = [i for i, (seg, pid, start, made) in self._segs.items() if process_start_time(pid) != start
                or (now - made > self.map_grace_s and not maps_inode(pid, seg.inode))]
        for ident in dead:
            self.drop(ident)
        self.reclaimed += len(dead)
        return len(dead)

    def close(self) -> None:
        for ident in list(self._segs):
            self.drop(ident)
