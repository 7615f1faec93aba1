"""The shared-memory data plane for clients on the daemon's host.

Loopback TCP copies every byte through the kernel twice; a shared segment does not.
The client creates a file in /dev/shm and maps it; the daemon maps the same file on
``Attach``; the client then unlinks the name (the mapping lives on, nothing leaks if
either side dies). Payloads are written at 64-byte aligned offsets chosen by the writer
of each message (client for Put, daemon for Get); zmq carries only the headers.
Who calls it: ``DaemonClient`` (create) and the daemon (attach).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^pdserve-kv-[0-9a-f]{8,64}$")
ALIGN = 64


class ShmSegment:
    def __init__(self, path: Path, size: int, create: bool) -> None:
        self.path, self.size = path, size
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shm segment {path} has {os.fstat(fd).st_size} bytes, client says {size}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> "ShmSegment":
        return cls(SHM_DIR / f"pdserve-kv-{os.getpid():x}{secrets.token_hex(8)}", size, create=True)

    @classmethod
    def attach(cls, path: str, size: int, max_size: int) -> "ShmSegment":
        p = Path(path)
        if p.parent != SHM_DIR or not _NAME.match(p.name):
            raise ValueError(f"shm path {path!r} is not a pdserve segment under {SHM_DIR}")
        if not 0 < size <= max_size:
            raise ValueError(f"shm segment of {size} bytes; limit is {max_size} (--kv-max-shm-bytes)")
        return cls(p, size, create=False)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._check(offset, src.size)
        self.buf[offset:offset + src.size] = src

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor with a copy of ``nbytes`` at ``offset``."""
        self._check(offset, nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.numpy()[:] = self.buf[offset:offset + nbytes]
        return out

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.buf = None
        self._mm.close()

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"shm range [{offset}, {offset + nbytes}) outside the {self.size}-byte segment")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
