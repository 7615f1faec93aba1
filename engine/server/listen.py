"""Listening sockets handed over by a parent: ``--fd N`` on ``pdserve node`` and ``pdserve proxy``.

A supervisor that picks a free port and then starts a child races every other process on the box: the
port is free when picked and can be someone's ephemeral port by the time the child binds it (CI saw a
decode node fail with EADDRINUSE after its TP ranks had started). ``LocalCluster`` therefore binds the
socket itself and passes it down (``pass_fds``); the child serves on it and never binds. The flag is
named after uvicorn's ``--fd``, which does the same for Unix sockets only.

    bound_socket(host, port)    the parent: a listening TCP socket (port 0: the kernel picks one)
    inherited_socket(fd)        the child: that socket, checked to be a listening TCP socket
"""

from __future__ import annotations

import socket


def add_fd_flag(parser) -> None:
    parser.add_argument("--fd", type=int, default=None, metavar="N",
                        help="serve on the listening socket inherited as file descriptor N (as uvicorn's --fd); "
                             "--host and --port are then ignored")


def bound_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on ``host:port``, inheritable by a child; raises OSError when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restarted child's old port in TIME_WAIT
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int | None) -> socket.socket | None:
    """The listening TCP socket behind ``fd`` (None when no fd was given); SystemExit naming the fd if it is not one."""
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except (OSError, ValueError) as exc:                  # ValueError: a negative fd
        raise SystemExit(f"--fd {fd}: not an open socket ({getattr(exc, 'strerror', None) or exc})") from None
    ok = (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
          and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    if not ok:
        sock.detach()
        raise SystemExit(f"--fd {fd}: not a listening TCP socket")
    return sock


def served_address(sock: socket.socket | None, host: str, port: int) -> tuple[str, int]:
    """(host, port) a server listens on: the inherited socket's, else the flags'."""
    return tuple(sock.getsockname()[:2]) if sock is not None else (host, port)
