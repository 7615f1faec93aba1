"""Fault injection in the worker ranks and the engine core, for the lifecycle tests and
``devbench/parallel_lifecycle.py``.

Off unless ``PDSERVE_FAULTS`` is set (``engine/envs.py``); the engine core and the ranks inherit it from
the driver:

    PDSERVE_FAULTS="slow_layers=/tmp/slow;slow_start=3"

    slow_layers=PATH    while PATH exists and holds ``SECONDS [RANK,RANK...]``, every decoder layer of those
                        ranks (every rank when none is named) takes SECONDS longer, ticking the heartbeat
                        every 0.2 s the way a stage of many slow layers does: a long step that keeps moving.
                        The test writes and removes PATH to slow a chosen step.
    slow_start=SECONDS  every rank sleeps this long before it loads its layers (a long model load).
    slow_step=SECONDS   the engine-core process (``--engine-core-process``) sleeps this long before every
                        step: a step longer than --rank-timeout that is not a hang.
    slow_core_connect=SECONDS   the engine-core process sleeps this long before it connects to the API
                        process's sockets: a test's own connection comes first (``engine/core/channel.py``).

Stopped and killed processes and oversized KV scatters need no hook: the tests signal pids and call
``KVRelay.scatter`` themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine import envs

_TICK_S = 0.2


@dataclass(frozen=True)
class Faults:
    slow_layers: str = ""
    slow_start: float = 0.0
    slow_step: float = 0.0
    slow_core_connect: float = 0.0


def parse(spec: str) -> Faults:
    """``"key=value;key=value"`` -> Faults; unknown keys and bad values are refused, naming the variable."""
    fields: dict = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        key, _, value = item.partition("=")
        if key == "slow_layers" and value:
            fields[key] = value
        elif key in ("slow_start", "slow_step", "slow_core_connect"):
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"PDSERVE_FAULTS: {key}={value!r} is not a number of seconds") from None
        else:
            raise ValueError(f"PDSERVE_FAULTS: unknown fault {item!r}; known: slow_layers=PATH, slow_start=SECONDS, "
                             "slow_step=SECONDS, slow_core_connect=SECONDS")
    return Faults(**fields)


FAULTS = parse(envs.PDSERVE_FAULTS)


def before_load() -> None:
    if FAULTS.slow_start:
        time.sleep(FAULTS.slow_start)


def before_core_step() -> None:
    if FAULTS.slow_step:
        time.sleep(FAULTS.slow_step)


def before_core_connect() -> None:
    if FAULTS.slow_core_connect:
        time.sleep(FAULTS.slow_core_connect)


def install(model, rank: int, heartbeat) -> None:
    """Slow this rank's decoder layers while the ``slow_layers`` file says so."""
    if not FAULTS.slow_layers:
        return
    path = Path(FAULTS.slow_layers)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: _slow_layer(path, rank, heartbeat))


def _slow_layer(path: Path, rank: int, heartbeat) -> None:
    try:
        words = path.read_text().split()
    except OSError:
        return
    ranks = {int(r) for r in words[1].split(",")} if len(words) > 1 else {rank}
    if not words or rank not in ranks:
        return
    end = time.monotonic() + float(words[0])
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(_TICK_S, left))
        heartbeat.tick()
