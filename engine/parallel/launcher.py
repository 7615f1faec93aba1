"""Start one machine's worker ranks: import torch once, then fork one process per rank.

    python -m pdserve.engine.parallel.launcher --master-addr A --master-port P --ranks 0,1 \
        --heartbeat-fd H --lifeline-fd L [--store-file F]   (started by ParallelExecutor; H and L inherited;
                                                    F: the ranks meet at the driver's FileStore, --nnodes 1)
    pdserve node ... --nnodes 2 --node-rank 1     (another machine: runs ``launch`` with its ranks)

Started by ``ParallelExecutor`` on the driver's machine (with the driver's heartbeat), or by
``pdserve node --node-rank N`` on another machine (it then creates its own heartbeat and mirrors it
to the driver, ``mirror.py``). Importing torch costs seconds of CPU per process; forked ranks share
the imported modules copy-on-write, so tp x pp ranks start about as fast as one. The launcher has
run no torch op and started no thread when it forks (a fork after that would inherit thread pools),
and has made no CUDA call, not even a device count (a CUDA driver initialised before fork() is
unusable in the children): each rank counts and binds its GPU itself (``devices.py``).
It then waits for its children, writes each one's exit status into the heartbeat (the driver is
not their parent, so it cannot ``waitpid`` them), and exits once every rank did.

Who stops whom, so nothing outlives the node and no reaped pid is ever signalled:

    driver ──lifeline pipe──> launcher      EOF (the driver closed it, or died in any way): the
                                            launcher SIGKILLs its unreaped ranks, reaps them, removes
                                            the driver's FileStore directory (--store-file), exits
    launcher ──PR_SET_PDEATHSIG──> ranks    a rank dies with its launcher, even a SIGKILLed one
    SIGINT / SIGTERM                        ignored by the launcher and the ranks, which run in their
                                            own session: Ctrl-C and a service manager's SIGTERM reach
                                            the driver, which drains and then stops the ranks in order
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import resource
import signal
import sys
import threading

import msgspec
import torch

from pdserve.engine import envs
from pdserve.engine.models import llama  # noqa: F401 - imported once here, shared by every forked rank
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel import shm
from pdserve.engine.parallel import worker
from pdserve.engine.parallel.broadcast import QueueHandle
from pdserve.engine.parallel.mirror import MirrorSender
from pdserve.engine.parallel.rendezvous import remove_file_store
from pdserve.engine.parallel.watchdog import Heartbeat

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def launch(master_addr: str, master_port: int, ranks: list[int], heartbeat_fd: int = -1, lifeline_fd: int = -1,
           node_rank: int = 0, world_size: int = 0, connect_timeout: float = 300.0, store_file: str = "") -> int:
    """Fork ``ranks``, wait for them; -> 0, or the first failure's exit code (128 + signal if killed).

    Without ``heartbeat_fd`` (another machine) a local heartbeat for ``world_size`` ranks is created
    and mirrored to the driver until every rank exited. With ``lifeline_fd``, its EOF kills the ranks. With
    ``store_file`` the ranks meet at that FileStore (the driver's machine), else at master_addr:master_port."""
    torch.set_num_threads(1)
    own = heartbeat_fd < 0
    fd = Heartbeat.create(world_size) if own else heartbeat_fd
    heartbeat = Heartbeat(fd)
    children = Children({_fork(rank, master_addr, master_port, fd, connect_timeout, store_file): rank
                         for rank in ranks})
    shm.close(fd)                                           # the ranks inherited it; the mapping stays
    if lifeline_fd >= 0:
        threading.Thread(target=_watch_lifeline, args=(lifeline_fd, children, store_file), name="pdserve-lifeline",
                         daemon=True).start()
    mirror = _start_mirror(heartbeat, node_rank, ranks, master_addr, master_port, children) if own else None
    code = children.reap(heartbeat)
    if mirror is not None:
        mirror.stop.set()
        mirror.send()                                       # the exit statuses reach the driver
    return code


class Children:
    """This launcher's ranks. One thread reaps them; any thread may ``kill_all``, which signals only ranks
    not reaped yet (an unreaped child's pid cannot be reused), under the lock the reaper takes to reap."""

    def __init__(self, pids: dict[int, int]):
        self._alive = dict(pids)                            # pid -> rank, until reaped
        self._lock = threading.Lock()

    def kill_all(self) -> None:
        with self._lock:
            for pid in self._alive:
                os.kill(pid, signal.SIGKILL)                # SIGKILL also ends a SIGSTOPped rank

    def reap(self, heartbeat: Heartbeat) -> int:
        """Wait for every rank, recording each exit in the heartbeat; -> the first failure's code, else 0."""
        worst = 0
        while self._alive:
            pid = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid      # exited, still unreaped
            with self._lock:
                rank = self._alive.pop(pid, None)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if rank is not None:
                heartbeat.record_exit(rank, code)
            worst = worst or (code if code > 0 else 128 - code if code < 0 else 0)
        return worst


def _watch_lifeline(fd: int, children: Children, store_file: str) -> None:
    """The driver holds the pipe's other end: EOF means it closed it (stop now) or died. Either way it is done
    with its FileStore: removed here too, so a SIGKILLed driver leaves no directory behind."""
    while os.read(fd, 1):
        pass
    logger.info("the driver closed the lifeline or exited; killing its ranks")
    remove_file_store(store_file)                           # first: this process exits once the ranks are reaped
    children.kill_all()


def _start_mirror(heartbeat, node_rank: int, ranks: list[int], addr: str, port: int, children: Children):
    store = worker.connect_store(addr, port, 300.0)
    spec = msgspec.json.decode(store.get(worker.SPEC_KEY), type=m.WorkerSpec)
    sender = MirrorSender(heartbeat, node_rank, ranks, msgspec.convert(spec.heartbeat_mirror, QueueHandle), store,
                          children.kill_all)
    sender.start()
    return sender


def _fork(rank: int, master_addr: str, master_port: int, heartbeat_fd: int, connect_timeout: float,
          store_file: str) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with_parent(parent)
        for sig in (signal.SIGINT, signal.SIGTERM):         # stopped by the driver (Shutdown) or SIGKILL only
            signal.signal(sig, signal.SIG_IGN)
        logging.basicConfig(level=envs.PDSERVE_LOG_LEVEL, force=True,
                            format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
        code = worker.run_rank(master_addr, master_port, rank, heartbeat_fd, connect_timeout, store_file)
    except BaseException:                                   # noqa: BLE001 - report, then leave without cleanup
        logging.getLogger("pdserve.worker").exception("rank %d failed", rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):                       # not Linux: the lifeline still kills the ranks
        pass
    if os.getppid() != parent:                              # the launcher died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-launcher")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks to start on this machine")
    p.add_argument("--heartbeat-fd", type=int, required=True, help="the driver's heartbeat (an inherited memfd)")
    p.add_argument("--lifeline-fd", type=int, required=True, help="read end of the driver's lifeline pipe")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the driver's store")
    p.add_argument("--store-file", default="",
                   help="the driver's FileStore (in its 0700 dir), in place of the TCPStore")
    args = p.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):             # see the module docstring
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=envs.PDSERVE_LOG_LEVEL, format="%(asctime)s launcher %(levelname)s %(name)s: %(message)s")
    raise_open_file_limit()
    return launch(args.master_addr, args.master_port, [int(r) for r in args.ranks.split(",")], args.heartbeat_fd,
                  args.lifeline_fd, connect_timeout=args.connect_timeout, store_file=args.store_file)


def raise_open_file_limit() -> None:
    """The ranks (forked from here) get the hard limit of open files as their soft limit: gloo keeps every
    connection another local user opens to a rank's loopback port, and at the soft limit its accept fails and the
    rank aborts (1024, a common default, took ~1,000 connections). This raises the bar; it does not close it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(main())
