"""One rank's share of one step: build inputs from the ``StepMessage``, run its layers, pass hidden on.

Called by the worker loop (``worker.py``) once per ``StepMessage``:

    tokens = stage.execute(message)     # [SampledToken] on the last stage's TP rank 0, else None

The step's requests are cut into up to ``pp`` micro-batches (contiguous, balanced by tokens); every
rank cuts the same way, so stage k works on micro-batch i + 1 while stage k + 1 works on i:

    stage 0:  mb0 ─isend─┐ mb1 ─isend─┐
    stage 1:             └ recv mb0 ──┴ recv mb1 ...        (last stage: logits -> sample, tp rank 0)

A decode micro-batch replays the stage's graph of its bucket where the rank has decode graphs (``graphs.py``: nccl
ranks; the bucket is a pure function of the message, ``plan_step``); the send / recv stay outside the graph.

Hidden states travel as one float tensor [T_mb, D] per micro-batch from (tp t, pp k) to
(tp t, pp k + 1) (TP ranks hold identical hidden states after each all-reduce): on CPU through gloo; with
nccl (one GPU per rank) device to device; with gloo over a shared GPU (``via_host``) through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.parallel.graphs import plan_step
from pdserve.engine.parallel.messages import SampledToken, StepMessage, StepRequest, micro_batches
from pdserve.engine.runner.input_batch import build_step_inputs
from pdserve.engine.runner.staging import StepStaging
from pdserve.engine.structured.bitmask import GrammarBitmask


@dataclass(frozen=True)
class Coords:
    rank: int
    tp: int
    pp: int
    tp_size: int
    pp_size: int

    @property
    def is_first(self) -> bool:
        return self.pp == 0

    @property
    def is_last(self) -> bool:
        return self.pp == self.pp_size - 1

    @property
    def samples(self) -> bool:
        return self.is_last and self.tp == 0

    def __str__(self) -> str:
        return f"tp {self.tp}, pp {self.pp}"


def stage_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each stage: contiguous, the first stages take the remainder."""
    if num_layers < pp_size:
        raise ValueError(f"the model has {num_layers} layers, fewer than --pipeline-parallel-size {pp_size}")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if i < extra else 0) for i in range(pp_size)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(pp_size)]


class StageRunner:
    def __init__(self, model, runner, coords: Coords, heartbeat, hidden_size: int, dtype: torch.dtype,
                 via_host: bool = False, graphs=None):
        self.model, self.runner, self.coords, self.heartbeat = model, runner, coords, heartbeat
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, runner.device
        self.via_host = via_host        # gloo with CUDA tensors: send/recv through the host (gloo has no GPU p2p)
        self.graphs = graphs            # StageGraphs (parallel/graphs.py): decode micro-batches replay, else None
        self.staging = None             # with graphs: one StepStaging whose decode steps land in the graphs' buffers
        if graphs is not None:
            self.staging = StepStaging(self.device)
            self.staging.graph_inputs = graphs.inputs
        for layer in model.layers:                 # progress inside a long forward: not a stall
            layer.register_forward_pre_hook(lambda *_: heartbeat.tick())

    @torch.inference_mode()
    def execute(self, message: StepMessage) -> list[SampledToken] | None:
        sends, tokens = [], []
        for i, (batch, bucket) in enumerate(self.plan(message)):
            sent, sampled = self._micro_batch(i, batch, bucket)
            sends += sent
            tokens += sampled
        if sends:
            self.heartbeat.enter("send_to_next_stage")
            for work in sends:
                work.wait()
        return tokens if self.coords.samples else None

    def plan(self, message: StepMessage) -> list[tuple[list[StepRequest], int | None]]:
        """[(micro-batch, the graph bucket it replays in, or None: eager)], from the message alone."""
        if self.graphs is None:
            return [(batch, None) for batch in micro_batches(message.requests, self.coords.pp_size)]
        return plan_step(message, self.coords.pp_size, self.graphs.sizes, self.graphs.width, self.runner.block_size)

    def _micro_batch(self, index: int, batch: list[StepRequest], bucket: int | None) -> tuple[list, list[SampledToken]]:
        items = [_Item(r) for r in batch]
        inputs = build_step_inputs(items, self.runner.block_size, self.device, backend=self.runner.attention_backend,
                                   staging=self.staging)
        self.runner.decode_splits.apply(inputs.attn)             # the same split-K rule as one rank's steps
        if bucket is not None:
            h = self._replay(index, inputs, bucket)                                              # [n, D]
        else:
            hidden = None
            if not self.coords.is_first:
                self.heartbeat.enter("recv_from_prev_stage")
                hidden = self._recv(len(inputs.input_ids), index)                              # [T, D]
            self.heartbeat.enter("forward")
            h = self.model(inputs.input_ids, inputs.positions, self.runner.kv_caches, inputs.attn, hidden=hidden)
        if not self.coords.is_last:
            h = h.cpu() if self.via_host else h.contiguous()                                    # [T, D]
            return [dist.isend(h, dst=self.coords.rank + self.coords.tp_size, tag=index)], []
        if not inputs.sample_requests:
            return [], []
        logits = self.model.compute_logits(h[inputs.sample_rows])                 # [S, V]
        if not self.coords.samples:
            return [], []
        self.heartbeat.enter("sample")
        bitmask = GrammarBitmask.from_row_bytes({r.request_id: r.bitmask for r in batch if r.bitmask is not None})
        results = self.runner.sample_requests(logits, inputs.sample_requests, bitmask)
        return [], [SampledToken(rid, r.token_id, r.logprob, r.top_logprobs) for rid, r in results.items()]


    def _replay(self, index: int, inputs, bucket: int) -> torch.Tensor:
        """A decode micro-batch of n rows by the stage's graph of ``bucket``: its inputs in the static buffers (staged
        there on CUDA, copied on CPU), the previous stage's hidden states received straight into ``hidden_in[:n]``
        (outside the graph), replay -> [n, D], a copy on stages that send it (the next replay rewrites the graph's
        output while an isend of it may still read)."""
        g, n = self.graphs, len(inputs.input_ids)
        g.prepare_step(inputs, bucket)
        if not self.coords.is_first:
            self.heartbeat.enter("recv_from_prev_stage")
            dist.recv(g.hidden_in[:n], src=self.coords.rank - self.coords.tp_size, tag=index)
        out = g.replay(bucket)[:n]
        return out if self.coords.is_last else out.clone()

    def _recv(self, rows: int, tag: int) -> torch.Tensor:
        """The previous stage's hidden states [rows, D] on this rank's device (nccl: straight into device memory)."""
        hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype,
                             device="cpu" if self.via_host else self.device)
        dist.recv(hidden, src=self.coords.rank - self.coords.tp_size, tag=tag)
        return hidden.to(self.device)


class _Tokens:
    """``all_token_ids`` of a request seen through a step: only [start, start + n) is known."""

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start: s.stop - self.start]


class _Request:
    """The attributes of ``Request`` that ``build_step_inputs`` and ``ModelRunner.sample_requests`` read."""

    def __init__(self, r: StepRequest):
        n = len(r.token_ids)
        self.request_id, self.block_ids, self.num_computed_tokens = r.request_id, r.block_ids, r.start
        self.num_tokens = r.start + n + (0 if r.sample else 1)     # sampled iff the chunk reaches the end
        self.sampling_params = r.params
        self.banned_token_ids, self.sampler_draws = r.banned, r.sampler_draws
        self.all_token_ids = r.history if r.history is not None else _Tokens(r.start, r.token_ids)
        self.output_token_ids = r.outputs or []


class _Item:
    def __init__(self, r: StepRequest):
        self.request, self.num_new_tokens = _Request(r), len(r.token_ids)
