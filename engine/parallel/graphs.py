"""Decode CUDA graphs on TP x PP ranks: which ranks capture, which bucket a step replays, and the captured stage.

Built by ``Worker._load`` after the rank's KV cache is allocated; used by ``StageRunner`` for every micro-batch:

    mode = graph_mode(choice, enforce_eager)     # logged once per rank, with its reason
        nccl (a GPU per rank)   -> "graphs": each stage's layers captured per batch bucket, the TP all-reduces
                                   (and the vocab-parallel embedding's) inside the graph; one replay per micro-batch
        gloo (shared GPU, or --dist-backend gloo) -> "eager": gloo's collectives run on the host, not capturable
        --enforce-eager         -> "eager" on every rank;  CPU ranks -> "eager" (no CUDA), or "stand-in" (tests:
                                   PDSERVE_RANK_GRAPHS_CPU=1: the captured function run eagerly, replay path)
    plan = plan_step(message, pp, sizes, width, block_size)
                                                 # [(micro-batch, bucket or None)]: a pure function of the broadcast
                                                 # StepMessage, so every rank replays the same bucket in each step
    h = graphs.replay(b)                         # [b, D]: the stage's hidden states, heartbeat "graph replay (bucket b)"

Per rank (``StageGraphs``, a ``DecodeGraphs`` whose forward takes a static hidden-state input on stages after the
first): static ids / positions / slots / seq_lens / table (``graph_inputs.py``), hidden_in [Bmax, D], one output per
bucket, all graphs in one memory pool; captured largest bucket first after an eager warm-up run of the same bucket
(its collectives also start the NCCL communicators). Every TP rank of a stage captures the same buckets in the same
order (``decode_splits.buckets`` of the same --max-num-seqs).

Pipeline stages: hidden states pass between stages outside the graph: the previous stage's are received straight
into hidden_in[:n] before the replay, this stage's output is cloned and sent after it (the next micro-batch's replay
may rewrite the output while the send still reads it). The LM head and its vocab all-gather run eagerly after the
replay, as vLLM does: a graph would keep a [b, V] logits output alive per bucket.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine import envs
from pdserve.engine.parallel.messages import StepMessage, StepRequest, micro_batches
from pdserve.engine.runner.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

GRAPHS, STAND_IN, EAGER = "graphs", "stand-in", "eager"


@dataclass(frozen=True)
class GraphMode:
    mode: str              # GRAPHS | STAND_IN | EAGER
    reason: str

    @property
    def replays(self) -> bool:
        return self.mode != EAGER


def graph_mode(choice, enforce_eager: bool, cpu_stand_in: bool | None = None) -> GraphMode:
    """-> how this rank runs decode steps, from its ``DeviceChoice`` (``devices.py``) and --enforce-eager.
    Every rank of a node gets the same answer: the backend is agreed by all (``devices.agree``)."""
    stand_in = envs.PDSERVE_RANK_GRAPHS_CPU if cpu_stand_in is None else cpu_stand_in
    if enforce_eager:
        return GraphMode(EAGER, "--enforce-eager: decode steps run eagerly")
    if choice.index is None:
        if stand_in:
            return GraphMode(STAND_IN, "CPU ranks: the stage function CUDA ranks capture runs eagerly through the "
                                       "replay path (PDSERVE_RANK_GRAPHS_CPU=1, tests)")
        return GraphMode(EAGER, "CPU ranks: CUDA graphs need a GPU")
    if choice.backend != "nccl":
        return GraphMode(EAGER, f"gloo, as chosen ({choice.reason}): its collectives go through the host, which a "
                                "CUDA graph cannot capture; decode steps run eagerly")
    return GraphMode(GRAPHS, "nccl: decode steps captured per batch bucket, the TP all-reduce inside the graph")


def capture_blocker(runner) -> str | None:
    """Why this rank's model cannot be captured (the attention backend is not Triton, dynamic RoPE), else None."""
    why = [f"attention backend {runner.attention_backend}"] if runner.attention_backend != "triton" else []
    if getattr(getattr(runner.model, "rotary", None), "dynamic", False):
        why.append("dynamic RoPE")
    return ", ".join(why) or None


def rank_mode(choice, enforce_eager: bool, runner) -> GraphMode:
    """``graph_mode``, then eager where the model cannot be captured: the mode a rank logs is the one it runs
    (``gpu_parallel_check.sh graphs`` counts the ranks that log "decode graphs (nccl")."""
    mode = graph_mode(choice, enforce_eager)
    why = capture_blocker(runner) if mode.mode == GRAPHS else None
    return GraphMode(EAGER, f"nccl, but {why}: decode steps run eagerly") if why else mode


def batch_bucket(batch: list[StepRequest], sizes: list[int], width: int, block_size: int) -> int | None:
    """The bucket a micro-batch replays in: one new token per request (a decode micro-batch), at most the largest
    bucket's rows, the blocks each needs within the graphs' table ``width``; else None (it runs eagerly)."""
    n = len(batch)
    if not n or n > sizes[-1]:
        return None
    if any(len(r.token_ids) != 1 or -(-(r.start + 1) // block_size) > width for r in batch):
        return None
    return next(s for s in sizes if s >= n)


def plan_step(message: StepMessage, pp_size: int, sizes: list[int], width: int,
              block_size: int) -> list[tuple[list, int | None]]:
    """[(micro-batch, its bucket or None)] of a step: a pure function of the broadcast message, the same on
    every rank (the micro-batches are ``messages.micro_batches``'s cut, as the stage runs them)."""
    return [(batch, batch_bucket(batch, sizes, width, block_size))
            for batch in micro_batches(message.requests, pp_size)]


class StageGraphs(DecodeGraphs):
    """One rank's stage forward per bucket: captured on CUDA (``mode`` graphs), or run eagerly (stand-in)."""

    def __init__(self, runner, max_model_len: int, heartbeat, hidden_size: int, dtype: torch.dtype, first: bool,
                 captured: bool):
        super().__init__(runner, max_model_len)
        self.heartbeat, self.captured = heartbeat, captured
        self.width = self.table.shape[1]
        self.hidden_in = None if first else torch.zeros(self.sizes[-1], hidden_size, dtype=dtype,
                                                        device=runner.device)     # [Bmax, D], filled by recv

    @classmethod
    def build(cls, runner, max_model_len: int, heartbeat, hidden_size: int, dtype: torch.dtype, first: bool,
              mode: GraphMode) -> "StageGraphs | None":
        """Capture (mode graphs) or prepare the stand-in; None where the model cannot replay (logged)."""
        if mode.mode == GRAPHS and capture_blocker(runner):
            logger.info("decode graphs off: %s", capture_blocker(runner))
            return None
        graphs = cls(runner, max_model_len, heartbeat, hidden_size, dtype, first, mode.mode == GRAPHS)
        if graphs.captured:
            graphs._capture_all()
        return graphs

    def _meta(self, b: int):
        meta = super()._meta(b)
        if not self.captured:             # stand-in: the CPU kernels read the lengths on the host, from the buffers
            meta.backend = self.runner.attention_backend
            meta.query_start_loc_cpu, meta.seq_lens_cpu = self.qsl[:b + 1], self.seq_lens[:b]
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        """THE captured function: the stage's layers over the static buffers' first b rows -> [b, D]."""
        hidden = None if self.hidden_in is None else self.hidden_in[:b]
        return self.model(self.ids[:b], self.positions[:b], self.runner.kv_caches, self._meta(b), hidden=hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with self.heartbeat.capturing():
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        start, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()                       # one pool for every bucket of this rank
        for b in reversed(self.sizes):                              # the same order on every rank
            try:
                self._capture(b, pool)
            except Exception as exc:
                raise RuntimeError(f"decode graphs: capturing bucket {b} failed ({type(exc).__name__}: {exc}); "
                                   "run the node with --enforce-eager") from exc
        torch.cuda.synchronize()
        logger.info("decode graphs: captured %d stage graphs (batch %d..%d) in %.1f s, %.1f MiB of graph memory",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.monotonic() - start,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**20)

    def _capture(self, b: int, pool) -> None:
        self._forward(b)                                            # warm-up: Triton kernels, NCCL communicators
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread's event queries do not invalidate this thread's capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs[b] = self._forward(b)
        self.graphs[b] = graph

    def prepare_step(self, inputs, bucket: int) -> None:
        """A decode micro-batch's inputs in the static buffers, rows n..bucket padded: staged there already (the
        stage's ``StepStaging``, Triton backend), else copied (``DecodeGraphs.prepare``)."""
        b = self.prepare(inputs)
        if b != bucket:
            raise RuntimeError(f"decode graphs: the message chose bucket {bucket}, the inputs {b}")

    def replay(self, bucket: int) -> torch.Tensor:
        """[bucket, D]: the stage's output for the rows loaded, under the heartbeat phase
        ``graph replay (bucket b)``: the same bookkeeping on CUDA (a replay) and CPU (the stand-in's eager call)."""
        with self.heartbeat.replaying(bucket):
            if self.captured:
                self.graphs[bucket].replay()
                return self.outputs[bucket]
            return self._forward(bucket)
