"""Start one machine's worker ranks: import torch once, then fork one process per rank.

    python -m pdserve.engine.parallel.launcher --master-addr A --master-port P --ranks 0,1 --heartbeat PATH
    pdserve node ... --nnodes 2 --node-rank 1     (another machine: runs ``main`` with its ranks)

Started by ``ParallelExecutor`` on the driver's machine (with the driver's heartbeat file), or by
``pdserve node --node-rank N`` on another machine (it then creates its own heartbeat file and
mirrors it to the driver, ``mirror.py``). Importing torch costs seconds of CPU per process;
forked ranks share the imported modules copy-on-write, so tp x pp ranks start about as fast as
one. The launcher is single-threaded and has run no torch op when it forks (a fork after that
would inherit thread pools). It then waits for its children, writes each one's exit status into
the heartbeat (the driver is not their parent, so it cannot ``waitpid`` them), and exits once
every rank did. A rank dies with the launcher (``PR_SET_PDEATHSIG``), never orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import msgspec
import torch

from pdserve.engine import envs
from pdserve.engine.models import llama  # noqa: F401 - imported once here, shared by every forked rank
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel import worker
from pdserve.engine.parallel.broadcast import QueueHandle
from pdserve.engine.parallel.mirror import MirrorSender
from pdserve.engine.parallel.watchdog import Heartbeat

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def launch(master_addr: str, master_port: int, ranks: list[int], heartbeat_path: str = "",
           node_rank: int = 0, world_size: int = 0, connect_timeout: float = 300.0) -> int:
    """Fork ``ranks``, wait for them; -> 0, or the first failure's exit code (128 + signal if killed).

    Without ``heartbeat_path`` (another machine) a local file for ``world_size`` ranks is created
    and mirrored to the driver until every rank exited."""
    torch.set_num_threads(1)
    own = not heartbeat_path
    path = Heartbeat.create(world_size) if own else heartbeat_path
    try:
        children = {_fork(rank, master_addr, master_port, path, connect_timeout): rank for rank in ranks}
        heartbeat = Heartbeat(path)
        mirror = _start_mirror(heartbeat, node_rank, ranks, master_addr, master_port, list(children)) if own else None
        code = _reap(children, heartbeat)
        if mirror is not None:
            mirror.stop.set()
            mirror.send()                                   # the exit statuses reach the driver
        return code
    finally:
        if own:
            os.unlink(path)


def _reap(children: dict[int, int], heartbeat: Heartbeat) -> int:
    worst = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is not None:
            heartbeat.record_exit(rank, code)
        worst = worst or (code if code > 0 else 128 - code if code < 0 else 0)
    return worst


def _start_mirror(heartbeat, node_rank: int, ranks: list[int], addr: str, port: int, pids: list[int]):
    store = worker.connect_store(addr, port, 300.0)
    spec = msgspec.json.decode(store.get(worker.SPEC_KEY), type=m.WorkerSpec)
    sender = MirrorSender(heartbeat, node_rank, ranks, msgspec.convert(spec.heartbeat_mirror, QueueHandle), store, pids)
    sender.start()
    return sender


def _fork(rank: int, master_addr: str, master_port: int, heartbeat_path: str, connect_timeout: float) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with_parent()
        logging.basicConfig(level=envs.PDSERVE_LOG_LEVEL, force=True,
                            format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
        code = worker.run_rank(master_addr, master_port, rank, heartbeat_path, connect_timeout)
    except BaseException:                                   # noqa: BLE001 - report, then leave without cleanup
        logging.getLogger("pdserve.worker").exception("rank %d failed", rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):                       # not Linux: the driver still kills ranks by pid
        pass
    if os.getppid() == 1:                                   # the launcher died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-launcher")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks to start on this machine")
    p.add_argument("--heartbeat", required=True, help="the driver's watchdog heartbeat file")
    args = p.parse_args(argv)
    logging.basicConfig(level=envs.PDSERVE_LOG_LEVEL, format="%(asctime)s launcher %(levelname)s %(name)s: %(message)s")
    return launch(args.master_addr, args.master_port, [int(r) for r in args.ranks.split(",")], args.heartbeat)


if __name__ == "__main__":
    sys.exit(main())
