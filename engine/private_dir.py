"""A directory only this user can enter, for a node's local meeting points: the engine-core channel's ipc
sockets (``engine/core/channel.py``) and the tp x pp ranks' rendezvous file (``engine/parallel/rendezvous.py``).

    path = private_dir.make("pdserve-core-", socket_names=("up", "down"))   # mode 0700, a fresh name
    private_dir.remove(path)                                                # its files, then itself

Where: under ``$XDG_RUNTIME_DIR`` when it is a directory of ours that no one else may write (a tmpfs the login
manager removes at logout), else under the temp dir (``$TMPDIR``, /tmp: sticky, and ``mkdtemp`` creates the name
exclusively). The kernel then decides who may reach what is inside: the node's user and root. An ipc socket path
must fit ``sun_path`` (107 bytes); a base too deep for ``socket_names`` is skipped for the next one.
"""

from __future__ import annotations

import os
import stat
import tempfile

SUN_PATH_MAX = 107                    # bytes of an AF_UNIX path, the terminating NUL left out (libzmq's limit too)
_RANDOM = 8                           # the length of mkdtemp's random part


def make(prefix: str, socket_names: tuple[str, ...] = ()) -> str:
    """A new 0700 directory; every ``<dir>/<name>`` of ``socket_names`` fits an AF_UNIX address."""
    longest = max((len(os.fsencode(n)) for n in socket_names), default=0)
    tried = []
    for base in _bases():
        if not socket_names or len(os.fsencode(base)) + 1 + len(prefix) + _RANDOM + 1 + longest <= SUN_PATH_MAX:
            return tempfile.mkdtemp(prefix=prefix, dir=base)
        tried.append(base)
    raise ValueError(f"no directory short enough for a unix socket path ({SUN_PATH_MAX} bytes at most): tried "
                     f"{', '.join(tried)}; set TMPDIR to a shorter path (e.g. /tmp)")


def remove(path: str | None) -> None:
    """Remove ``path``'s entries and ``path`` (no subdirectories are made in it); missing ones are fine."""
    if not path:
        return
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def _bases() -> list[str]:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    bases = [runtime] if runtime and _ours(runtime) else []
    return bases + [tempfile.gettempdir(), "/tmp"]


def _ours(path: str) -> bool:
    """A real directory owned by this user that no one else may write (a symlink or a shared dir is not)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
