"""Shared memory that cannot leak: anonymous files (memfd) handed down by fd number, never a /dev/shm name.

    fd = shm.create(nbytes, "pdserve-mq")   # the driver (or a remote node's launcher)
    spawn_launcher(..., pass_fds=[fd])      # the same number in the launcher; its forked ranks inherit it
    mm = shm.map(fd)                        # any of those processes: a shared mapping of the same pages
    shm.close(fd)                           # the creator, once it no longer hands the fd to new children

The memory lives while any process holds the fd or a mapping and is freed by the kernel when the
last one exits, however it exits (SIGKILL included): there is no name to unlink. Only descendants
that inherited the fd can attach; ranks on other machines use zmq (``broadcast.py``, ``mirror.py``).
"""

from __future__ import annotations

import mmap
import os


def create(nbytes: int, name: str) -> int:
    """A zero-filled anonymous file of ``nbytes`` (close-on-exec: pass it on with ``pass_fds``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map(fd: int) -> mmap.mmap:   # noqa: A001 - mirrors mmap's own name
    """Map the whole file (the mapping keeps the memory alive after ``fd`` is closed)."""
    return mmap.mmap(fd, 0)


def close(fd: int) -> None:
    os.close(fd)
