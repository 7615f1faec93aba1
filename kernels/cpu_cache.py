"""The C kernels' library cache, ``PDSERVE_CACHE_DIR/kernels/<stem>-<key>.so``: private to the user running pdserve.

    fd = open_cache()                          # the kernels folder, checked; None where it is not to be trusted
    lib, why = lookup(fd, name, symbols)       # the cached library, checked and loaded; (None, why) on a miss
    lib = install(fd, name, data, symbols)     # the built bytes stored under ``name`` and loaded

Called by ``cpu_build.build`` (the only caller), which passes ``private_dir()`` to ``install`` where
``open_cache`` said no. A cached library is loaded as code (dlopen runs its constructors), so -- DESIGN.md's
trust boundary -- it is used only where it and every folder from PDSERVE_CACHE_DIR down to it belong to this
process's user and are writable by no one else. Each folder below PDSERVE_CACHE_DIR and the file are opened
relative to the folder above with O_NOFOLLOW (a symlink is refused; PDSERVE_CACHE_DIR itself may be one: what it
names is checked), each check is fstat on the open descriptor, and the file is dlopened as /proc/self/fd/N, so
the file checked is the file loaded. Folders are made 0700 and files 0700: the cache is not shared between users.
A cache folder that fails a check is neither read nor written -- the kernels are built in a private temporary
folder for this process, and one warning says why; a cached file that fails one (or lacks a symbol) is rebuilt
over. Libraries stay loaded, and their descriptors open, for the life of the process: glibc knows a library
by the name it was opened by, and a closed descriptor's number would name the next file opened.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine import envs

log = logging.getLogger(__name__)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOADED: dict[tuple[int, int], ctypes.CDLL] = {}      # (st_dev, st_ino) -> the library, its descriptor kept open
_LOCK = threading.Lock()
_WARNED: set[str] = set()


class Untrusted(OSError):
    """A cache folder or file that another user could have written (its reason says which and how)."""


def open_cache() -> int | None:
    """The descriptor of PDSERVE_CACHE_DIR/kernels, made 0700 where missing, every folder checked; None (with
    one warning for each distinct reason) where it is not to be used."""
    return open_subdir("kernels", "C kernel cache", "the kernels are built in a private temporary folder for this "
                       "process (each start builds them again until the cache is fixed)")


def open_subdir(name: str, what: str, instead: str) -> int | None:
    """The descriptor of PDSERVE_CACHE_DIR/``name`` (a folder whose files are loaded as code: the C kernels',
    inductor's), made 0700 where missing, it and PDSERVE_CACHE_DIR checked; None, with one warning naming
    ``what`` and what happens ``instead``, where another user could have written it."""
    root = envs.PDSERVE_CACHE_DIR
    try:
        root_fd = _open_dir(str(root), None, root, follow=True)
        try:
            return _open_dir(name, root_fd, root / name)
        finally:
            os.close(root_fd)
    except OSError as e:
        warn_once(f"{what} {root / name} not used: {e}; {instead} (PDSERVE_CACHE_DIR names the cache: a folder "
                  f"only this user can write)")
        return None


def private_dir() -> tuple[int, str]:
    """A fresh folder only this process's user can use, its descriptor and path (the caller removes it)."""
    import tempfile

    path = tempfile.mkdtemp(prefix="pdserve-kernels-")      # 0700, made here
    return os.open(path, _DIR | os.O_NOFOLLOW), path


def lookup(dir_fd: int, name: str, symbols: Sequence[str]) -> tuple[ctypes.CDLL | None, str | None]:
    """The library cached as ``name`` with all of ``symbols``, or (None, why not): None where none is cached."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{name} {_not_opened(e, name, dir_fd)}"
    why = _check(fd, regular=True)
    if why is not None:
        os.close(fd)
        return None, f"{name} {why}"
    try:
        lib = load_fd(fd)
    except OSError as e:
        return None, f"{name} does not load: {e}"
    missing = [s for s in symbols if not hasattr(lib, s)]
    return (None, f"{name} lacks {', '.join(missing)}") if missing else (lib, None)


def install(dir_fd: int, name: str, data: bytes, symbols: Sequence[str]) -> ctypes.CDLL:
    """``data`` (a built library) stored as ``name`` in the folder: written 0700 to a temporary name, loaded,
    checked for ``symbols`` and renamed, so no process sees a half-written or wrong library."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o700)
        lib, why = lookup(dir_fd, tmp, symbols)
        if lib is None:
            raise OSError(f"the library built: {why or 'vanished'}")
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return lib
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def load_fd(fd: int) -> ctypes.CDLL:
    """dlopen the file open at ``fd`` (checked by the caller), which this takes over and keeps open; the library
    already loaded where this file (device, inode) was."""
    st = os.fstat(fd)
    with _LOCK:
        lib = _LOADED.get((st.st_dev, st.st_ino))
        if lib is not None:
            os.close(fd)
            return lib
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except OSError:
            os.close(fd)
            raise
        _LOADED[(st.st_dev, st.st_ino)] = lib
        return lib


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def _open_dir(name: str, dir_fd: int | None, path: Path, follow: bool = False) -> int:
    """The folder ``name`` (relative to ``dir_fd``), made 0700 where missing, checked; raises Untrusted."""
    flags = _DIR if follow else _DIR | os.O_NOFOLLOW
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if dir_fd is None:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:                  # made meanwhile: checked like any other below
            pass
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        raise Untrusted(f"{path} {_not_opened(e, name, dir_fd)}") from None
    why = _check(fd, regular=False)
    if why is not None:
        os.close(fd)
        raise Untrusted(f"{path} {why}")
    return fd


def _check(fd: int, regular: bool) -> str | None:
    """Why the open file or folder at ``fd`` is not to be trusted, or None."""
    st, me = os.fstat(fd), os.geteuid()
    if st.st_uid != me:
        return f"belongs to uid {st.st_uid}, not to this process's uid {me}"
    if st.st_mode & 0o022:
        who = "its group and others" if st.st_mode & 0o022 == 0o022 else "its group" if st.st_mode & 0o020 else \
            "others"
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}; chmod go-w it)"
    if regular and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    return None


def _not_opened(e: OSError, name: str, dir_fd: int | None) -> str:
    """Why ``name`` did not open: a symlink gives ELOOP, or ENOTDIR where a folder was asked for."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link or e.errno == errno.ELOOP:
        return "is a symlink (refused)"
    return "is not a folder" if e.errno == errno.ENOTDIR else f"cannot be opened: {e.strerror}"
