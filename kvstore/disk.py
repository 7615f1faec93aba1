"""L3: one file per object in a local directory, under a byte budget, LRU.

Who calls it: ``TieredStore`` (write-through worker and read misses), tests.
A file is named by the xxh3_128 of its key and written atomically (temp file + rename),
so a reader never sees half an object. The directory is made 0700 and files 0600; a file is opened
without following links and read only up to ``max_blob_bytes`` (a larger one is refused unread), so a
directory shared with others costs hits, never memory or a wrong object (the MAC in ``seal.py``). The index (file -> size, LRU order) lives in
memory and is rebuilt from the directory at start (oldest mtime first). One process owns
a directory. Budget: ``bytes <= capacity_bytes`` after every put; an object larger than
the budget is rejected and counted. A write that fails (ENOSPC) deletes its temp file and
raises (counted in ``errors``; ``TieredStore`` marks the tier down).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

from pdserve.kvstore.blob import BlobTier
from pdserve.kvstore.codec import DEFAULT_MAX_OBJECT_BYTES

log = logging.getLogger(__name__)
_SUFFIX = ".kv"


class DiskTier(BlobTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, codec_name: str = "none",
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        super().__init__(codec_name, max_object_bytes)
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier needs a budget > 0 bytes, got {capacity_bytes} (--kv-disk-bytes)")
        self.dir, self.capacity_bytes = Path(directory), capacity_bytes
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._index: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._load_index()

    def path_of(self, key: str) -> Path:
        return self.dir / (xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX)

    def _write(self, blobs: list[tuple[str, bytes]]) -> None:
        for key, blob in blobs:
            if len(blob) > self.capacity_bytes:
                self._stats.add(rejected=1)
                continue
            path = self.path_of(key)
            self._write_file(path, blob)
            with self._lock:
                self._account(path.name, len(blob))

    def _write_file(self, path: Path, blob: bytes) -> None:
        """Temp file + rename; a failed write (disk full) removes its temp file and raises."""
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{threading.get_ident()}")
        try:
            write_new_file(tmp, blob)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)     # else it stays, outside the budget, and a full disk stays full
            raise

    def _read(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            name = self.path_of(key).name
            with self._lock:
                known = name in self._index
                if known:
                    self._index.move_to_end(name)
            out.append(self._read_file(name) if known else None)
        return out

    def _exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [self.path_of(k).name in self._index for k in keys]

    def _remove(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._drop(self.path_of(key).name, evicted=False)

    def _read_file(self, name: str) -> bytes | None:
        """The file's bytes; b"" (a counted corrupt object) when it is not a plain file or too large."""
        try:
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            with self._lock:
                self._drop(name, evicted=False)
            return None
        except OSError as exc:              # ELOOP: a symlink someone put there
            log.warning("disk tier: %s cannot be opened (%s); treated as corrupt", name, exc)
            return b""
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_blob_bytes:
                log.warning("disk tier: %s is not a regular file of at most %d bytes; treated as corrupt",
                            name, self.max_blob_bytes)
                return b""
            return f.read(st.st_size)                 # what fstat saw (<= the limit): a file grown since is cut

    def _account(self, name: str, size: int) -> None:
        """Record a written file, then evict oldest files until the budget holds."""
        old = self._index.pop(name, None)
        self._stats.add(objects=1 - (old is not None), bytes=size - (old or 0))
        self._index[name] = size
        while self._stats.bytes > self.capacity_bytes:
            self._drop(next(iter(self._index)), evicted=True)

    def _drop(self, name: str, evicted: bool) -> None:
        size = self._index.pop(name, None)
        if size is None:
            return
        (self.dir / name).unlink(missing_ok=True)
        self._stats.add(objects=-1, bytes=-size, evictions=int(evicted))
        if evicted:
            log.debug("disk tier evicted %s (%d bytes)", name, size)

    def _load_index(self) -> None:
        for tmp in self.dir.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        with self._lock:
            for path in files:
                self._account(path.name, path.stat().st_size)


def write_new_file(path: Path, blob: bytes) -> None:
    """A new file only this user can read (0600), never through a link someone put at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
