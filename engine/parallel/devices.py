"""Which device a rank binds and which torch.distributed backend its groups use: one pure function.

Called by ``Worker`` (``worker.py``) at start-up, before ``init_process_group``:

    choice = select_device(device, ranks_per_node, local_rank_of(rank, ranks_per_node), visible_devices, requested)
    # DeviceChoice(device="cuda:1", index=1, backend="nccl", reason="8 ranks on this machine, 8 visible GPUs ...")

    device    cpu      -> cpu, gloo (nccl asked: refused)
              cuda     -> GPU ``local_rank`` when there are at least as many visible GPUs as ranks on this machine,
                          nccl (all-reduce, all-gather, send/recv between devices; gloo when asked);
                          fewer GPUs than ranks (tests, a single-GPU machine): ranks share them round-robin
                          (local_rank % visible) and use gloo with CUDA tensors (NCCL refuses two ranks on one
                          device); nccl asked then is refused; no visible GPU: refused
    visible_devices       ``torch.cuda.device_count()`` in the rank, which honours CUDA_VISIBLE_DEVICES: index i
                          is the i-th GPU that variable lists
    requested             --dist-backend: auto | nccl | gloo

Errors name the values, the limit and the flag. The caller logs ``reason`` once per rank.

Every rank must pass the same backend to ``init_process_group``, but each machine chooses from its own GPU
count (8 GPUs on one machine -> nccl, 4 for 8 ranks on another -> gloo). So the worker publishes each rank's
choice in the rendezvous store and applies ``agree`` to all of them before the group starts:

    choice = agree(choice, [backend of rank 0, ..., backend of rank W-1])   # any gloo -> every rank gloo
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "nccl", "gloo")


class DeviceSelectionError(ValueError):
    """The requested device / backend cannot run this layout; the message names the flag to change."""


@dataclass(frozen=True)
class DeviceChoice:
    device: str                 # "cpu" or "cuda:<index>"
    index: int | None           # the CUDA device index (within CUDA_VISIBLE_DEVICES), None on CPU
    backend: str                # "gloo" or "nccl"
    reason: str

    @property
    def shared(self) -> bool:
        """Ranks share this GPU: collectives and stage hand-offs go through gloo (send/recv via the host)."""
        return self.index is not None and self.backend == "gloo"


def local_rank_of(rank: int, ranks_per_node: int) -> int:
    """A rank's index on its machine: machine n runs ranks [n * R, (n + 1) * R) (``--node-rank n``)."""
    return rank % ranks_per_node


def select_device(device: str, ranks_per_node: int, local_rank: int, visible_devices: int,
                  requested: str = "auto") -> DeviceChoice:
    """-> the rank's ``DeviceChoice``; raises ``DeviceSelectionError`` for a layout that cannot run."""
    if requested not in BACKENDS:
        raise DeviceSelectionError(f"--dist-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if ranks_per_node < 1 or not 0 <= local_rank < ranks_per_node:
        raise DeviceSelectionError(f"local rank {local_rank} is outside [0, {ranks_per_node}) ranks on this machine")
    if device == "cpu":
        if requested == "nccl":
            raise DeviceSelectionError("--dist-backend nccl needs --device cuda; CPU ranks use gloo")
        return DeviceChoice("cpu", None, "gloo", "CPU ranks: gloo")
    if device != "cuda":
        raise DeviceSelectionError(f"a rank's device must be cpu or cuda, got {device!r}")
    if visible_devices < 1:
        raise DeviceSelectionError("--device cuda: no visible CUDA device in this rank (torch.cuda.device_count() "
                                   "is 0; check CUDA_VISIBLE_DEVICES and the driver)")
    layout = f"{ranks_per_node} rank(s) on this machine, {visible_devices} visible GPU(s)"
    if visible_devices >= ranks_per_node:
        if requested == "gloo":
            return DeviceChoice(f"cuda:{local_rank}", local_rank, "gloo", f"{layout}: one GPU per rank, gloo as asked "
                                "(--dist-backend gloo; hidden states pass through the host)")
        return DeviceChoice(f"cuda:{local_rank}", local_rank, "nccl", f"{layout}: one GPU per rank, nccl")
    if requested == "nccl":
        raise DeviceSelectionError(f"--dist-backend nccl: {layout}; NCCL needs one GPU per rank (it refuses two "
                                   "ranks on one device). Expose more GPUs (CUDA_VISIBLE_DEVICES), lower -tp x -pp "
                                   "per node, or use --dist-backend auto|gloo")
    index = local_rank % visible_devices
    return DeviceChoice(f"cuda:{index}", index, "gloo", f"{layout}: ranks share GPUs (rank {local_rank} on GPU "
                        f"{index}), gloo with CUDA tensors (hidden states pass through the host)")


def agree(choice: DeviceChoice, backends: list[str]) -> DeviceChoice:
    """-> ``choice`` with the backend every rank can run: gloo as soon as one rank needs it (a machine whose ranks
    share GPUs), else nccl. A rank with its own GPU then keeps it and passes tensors through the host."""
    if choice.backend == "gloo" or "gloo" not in backends:
        return choice
    others = sorted({r for r, b in enumerate(backends) if b == "gloo"})
    return DeviceChoice(choice.device, choice.index, "gloo", f"{choice.reason}; gloo, not nccl: rank(s) {others} "
                        "on other machines share GPUs and every rank must use one backend (hidden states pass "
                        "through the host)")
