"""The driver's half of start-up: the rendezvous store and the launcher process (``ParallelExecutor``).

    store, path = file_store(timeout)                 # --nnodes 1: a FileStore in a 0700 directory
    store = rendezvous_store(addr, port, timeout)     # --nnodes > 1: a TCPStore listening on --master-addr only
    launcher, lifeline = spawn_launcher(addr, store.port or 0, ranks, heartbeat_fd, ring_fds, store_file=path)
    remove_file_store(path)                           # once the launcher and its ranks are gone

With every rank on this machine (--nnodes 1) the ranks meet at a file in a directory of the node's own
(``private_dir``, mode 0700): only the node's user (and root) can read the worker spec or write a key.
A TCPStore, even on 127.0.0.1, lets any local user do both: one that rewrote the spec while the ranks
started had them load its own weights (tried, as uid nobody). With --nnodes > 1 the machines must meet
over TCP: the port is --master-port on --master-addr, and since, given only a port, TCPStore listens on
every interface, the socket is bound here and handed to the store; whoever reaches it can still read and
write every key (docs/threat-model.md). With --nnodes 1, gloo's own
listeners are put on the interface that holds --master-addr too (``GLOO_SOCKET_IFNAME``, unless set):
left alone, gloo listens wherever the hostname resolves. The launcher runs in its own session, inherits the
heartbeat and the rings as fds (``shm.py``) and the read end of the lifeline pipe, whose EOF (the
driver closed it or died) makes it kill its ranks (``launcher.py``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from pdserve.engine import private_dir

LOCAL_CONNECT_TIMEOUT_S = 30.0     # the store is up before the local launcher starts: a rank that cannot reach it quits
_SIOCGIFADDR = 0x8915


def file_store(timeout: float) -> tuple[dist.FileStore, str]:
    """-> (a FileStore for this machine's ranks, its path), in a fresh 0700 directory (``remove_file_store``)."""
    path = os.path.join(private_dir.make("pdserve-ranks-"), "store")
    store = dist.FileStore(path, -1)                      # -1: no fixed user count, the file stays until removed
    store.set_timeout(timedelta(seconds=timeout))
    return store, path


def remove_file_store(path: str) -> None:
    if path:
        private_dir.remove(os.path.dirname(path))


def rendezvous_store(addr: str, port: int, timeout: float) -> dist.TCPStore:
    """The TCPStore the ranks meet at, listening on ``addr`` only (given just a port, TCPStore listens on every
    interface, and anyone who reaches it can read the worker spec or set the keys that kill ranks)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise OSError(f"the rendezvous store cannot listen on --master-addr {addr} --master-port {port}: "
                      f"{exc}") from exc
    fd = sock.detach()                                      # the store owns (and closes) it from here
    try:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def spawn_launcher(master_addr: str, master_port: int, ranks: list[int], heartbeat_fd: int, fds: list[int],
                   debug_sync: bool = False, all_ranks_here: bool = True,
                   store_file: str = "") -> tuple[subprocess.Popen, int]:
    """-> (the launcher, the write end of its lifeline). It inherits ``heartbeat_fd`` and ``fds`` (the rings); its
    ranks meet at ``store_file`` (a FileStore) when given, else at the TCPStore on ``master_addr:master_port``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    ifname = interface_of(master_addr) if all_ranks_here else None
    if ifname and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = ifname                # gloo's listeners where the store listens
    if debug_sync:
        env["CUDA_LAUNCH_BLOCKING"] = "1"                 # every kernel synchronous, errors at their call site
    read, write = os.pipe()                              # both close-on-exec: only pass_fds reach the launcher
    cmd = [sys.executable, "-m", "pdserve.engine.parallel.launcher", "--master-addr", master_addr,
           "--master-port", str(master_port), "--ranks", ",".join(map(str, ranks)),
           "--heartbeat-fd", str(heartbeat_fd), "--lifeline-fd", str(read),
           "--connect-timeout", str(LOCAL_CONNECT_TIMEOUT_S)] + (["--store-file", store_file] if store_file else [])
    try:
        proc = subprocess.Popen(cmd, env=env, pass_fds=[heartbeat_fd, read, *fds], start_new_session=True)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return proc, write


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 ``addr`` (Linux): "lo" for 127.0.0.0/8; None when none does."""
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return None
    if ipaddress.ip_address(ip).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(info[20:24]) == ip:
                return name
    return None
