"""The lifecycle matrix of a tp x pp node: signal the node (or one rank) at a moment, measure what is left.

Who calls it: tests/test_parallel_lifecycle.py (the cheapest cases, in CI) and, for the whole matrix:

    python devbench/parallel_lifecycle.py --model DIR [--cases node-SIGTERM-load,rank-SIGSTOP-load] [--json out.json]

Each case starts ``pdserve node --model DIR -tp 2 -pp 2 --rank-timeout 2`` in its own session (as a
shell or a service manager does), reaches a moment and sends a signal:

    node  SIGINT (to the node's process group, as Ctrl-C does) | SIGTERM | SIGKILL
          x  start-up (the ranks sleep in their model load: PDSERVE_FAULTS=slow_start)
             idle (healthy, nothing running) | load (a streaming completion is in flight)
    rank  SIGKILL | SIGSTOP of rank 3 (tp 1, pp 1) under load; then the node gets SIGTERM
    slow-stage  -pp 2 --rank-timeout 1: stage 0 runs a 70 s step that keeps moving (PDSERVE_FAULTS=slow_layers)
                while stage 1 waits in recv: longer than gloo's old timeout (2 x rank timeout + 60 s)

Per case: the node's exit status, its last message (or the report the client got), seconds from the
signal to the exit (node signals) or to the client's error (rank signals), leftover processes
(the launcher and ranks, tracked even when forked after the node died), listening ports of the node
and its descendants, new /dev/shm entries, and what the in-flight streaming client received.
Every process a case started is killed by pid at its end, and what it leaked in /dev/shm removed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from lifecycle_probe import Node, Stream, shm_entries

RANK_TIMEOUT = 2.0


@dataclass
class Outcome:
    case: str
    exit_status: str                 # the node's return code, with the signal's name when killed
    message: str                     # the node's last log line, or the error the client received
    report_s: float | None           # signal -> node exit (node cases) or -> the client's error (rank cases)
    leftover_pids: list[int] = field(default_factory=list)
    leftover_ports: list[int] = field(default_factory=list)
    leftover_shm: list[str] = field(default_factory=list)
    client: str = "-"                # what the in-flight streaming request received
    errors: list[str] = field(default_factory=list)   # ERROR / traceback lines the node and its ranks printed

    @property
    def clean(self) -> bool:
        return not (self.leftover_pids or self.leftover_ports or self.leftover_shm)


CASES = [f"node-{s}-{m}" for s in ("SIGINT", "SIGTERM", "SIGKILL") for m in ("start-up", "idle", "load")] + \
        ["rank-SIGKILL-load", "rank-SIGSTOP-load", "slow-stage"]


def run_case(model: str, case: str, layout: tuple[str, ...] = ("-tp", "2", "-pp", "2"),
             max_tokens: int = 400) -> Outcome:
    """Run one case of ``CASES`` (``node-SIGTERM-load`` with ``layout=("-tp", "1")`` for a single-rank node)."""
    if case == "slow-stage":
        return _slow_stage(model)
    who, sig_name, moment = case.split("-", 2)
    sig = signal.Signals[sig_name]
    env = {"PDSERVE_FAULTS": "slow_start=60"} if moment == "start-up" else {}
    shm_before = shm_entries()
    node = Node(model, [*layout, "--rank-timeout", str(RANK_TIMEOUT)], env)
    try:
        stream = _reach(node, moment, max_tokens)
        ports = node.listening_ports()
        outcome = (_signal_node if who == "node" else _signal_rank)(node, sig, stream)
        outcome.case = case
        outcome.errors = node.error_lines()
        outcome.leftover_ports = sorted(ports & node.ports_listening_now(ports))
        outcome.leftover_shm = sorted(shm_entries() - shm_before)
        return outcome
    finally:
        node.kill_everything()
        _remove_shm(shm_entries() - shm_before)


def _reach(node: Node, moment: str, max_tokens: int) -> Stream | None:
    if moment == "start-up":
        node.wait_for(lambda: len(node.ranks()) == node.world_size, 120, "every rank forked")
        return None
    node.wait_healthy(180)
    if moment == "idle":
        return None
    stream = Stream(node.url, max_tokens)
    node.wait_for(lambda: stream.tokens >= 5 or stream.finished.is_set(), 60, "the first tokens streamed")
    return stream


def _signal_node(node: Node, sig: signal.Signals, stream: Stream | None) -> Outcome:
    sent = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(node.proc.pid, sig)          # Ctrl-C: the terminal signals the whole foreground group
    else:
        os.kill(node.proc.pid, sig)
    code = node.wait_exit(90)
    left = node.wait_descendants_gone(30)
    report_s = time.monotonic() - sent
    client = stream.result(30) if stream else "-"
    return Outcome("", _status(code), node.last_line(), round(report_s, 2), left, client=client)


def _signal_rank(node: Node, sig: signal.Signals, stream: Stream | None) -> Outcome:
    victim = node.ranks()[3]
    sent = time.monotonic()
    os.kill(victim, sig)
    client = stream.result(RANK_TIMEOUT + 60) if stream else "-"
    report_s = (stream.ended_at - sent) if stream and stream.ended_at else None
    left = node.wait_descendants_gone(15)
    os.kill(node.proc.pid, signal.SIGTERM)
    code = node.wait_exit(60)
    message = client.split(": ", 1)[-1] if client.startswith("error") else node.last_line()
    return Outcome("", _status(code), message, report_s and round(report_s, 2), left, client=client)


def _slow_stage(model: str) -> Outcome:
    """Stage 0's step takes 70 s and keeps moving; stage 1 waits in recv all along. Nothing may be killed."""
    shm_before = shm_entries()
    with tempfile.TemporaryDirectory() as tmp:
        slow = os.path.join(tmp, "slow")
        node = Node(model, ["-pp", "2", "--rank-timeout", "1"], {"PDSERVE_FAULTS": f"slow_layers={slow}"})
        try:
            node.wait_healthy(180)
            with open(slow, "w") as f:
                f.write("70 0")
            sent = time.monotonic()
            stream = Stream(node.url, 1)                     # one step: the prefill, 70 s on stage 0
            client = stream.result(200)
            os.unlink(slow)
            took = time.monotonic() - sent
            ports = node.listening_ports()
            os.kill(node.proc.pid, signal.SIGTERM)
            code = node.wait_exit(60)
            left = node.wait_descendants_gone(15)
            return Outcome("slow-stage", _status(code), node.last_line(), round(took, 2), left,
                           sorted(ports & node.ports_listening_now(ports)), sorted(shm_entries() - shm_before), client,
                           node.error_lines())
        finally:
            node.kill_everything()
            _remove_shm(shm_entries() - shm_before)


def _remove_shm(names: set[str]) -> None:
    """What a case leaked (builds that named their rings in /dev/shm): measured above, removed here."""
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


def _status(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def table(outcomes: list[Outcome]) -> str:
    head = "| case | exit | s to report | leftover pids / ports / shm | client received | message |\n" \
           "| --- | --- | --- | --- | --- | --- |"
    rows = [f"| {o.case} | {o.exit_status} | {o.report_s} | {len(o.leftover_pids)} / {len(o.leftover_ports)} / "
            f"{len(o.leftover_shm)} | {o.client} | {o.message[:140]} |" for o in outcomes]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory (pdserve make-tiny-model DIR)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--json", default=None, help="write the outcomes here")
    args = p.parse_args(argv)
    outcomes = []
    for case in args.cases.split(","):
        print(f"running {case} ...", file=sys.stderr, flush=True)
        outcomes.append(run_case(args.model, case))
        print(f"  {asdict(outcomes[-1])}", file=sys.stderr, flush=True)
    print(f"host: {os.cpu_count()} CPUs; tp2 x pp2 nodes, --rank-timeout {RANK_TIMEOUT}")
    print(table(outcomes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    return 0 if all(o.clean for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
