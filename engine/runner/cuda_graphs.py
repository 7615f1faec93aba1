"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket, replayed per step.

Built by ``ModelRunner`` on CUDA unless ``--enforce-eager``; ``ModelRunner.execute`` asks
``graphs.run(inputs)`` for every step and gets ``None`` back when the step cannot replay (a prefill
row, more rows than the largest bucket, the torch backend, dynamic RoPE):

    static buffers   ids, positions, slots [Bmax]; query_start_loc [Bmax + 1] (= 0, 1, 2, ...);
                     seq_lens [Bmax]; block_table [Bmax, max_blocks]: views of one int32 buffer
                     (``graph_inputs.py``) that the step's staging copy lands in; one output [Bmax, hidden]
    capture(b)       forward over the first b rows, metadata with max_seq_len = max_model_len and the
                     split-K count of bucket b (``decode_splits.py``: eager decode steps use the same)
    run(B rows)      the step was staged into the buffers, rows B..b padded (slot -1: nothing written;
                     seq_len 1): replay bucket b >= B, return output[:B] -- no device copy before the replay

Buckets: 1, 2, 4, then multiples of 8 up to ``--max-num-seqs`` (vLLM's shape; ``decode_splits.buckets``).
All graphs share one memory pool; the largest is captured first. Capture time and graph memory are logged once.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.runner.decode_splits import DecodeSplits
from pdserve.engine.runner.graph_inputs import GraphInputs
from pdserve.kernels import AttentionMetadata

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, runner, max_model_len: int):
        self.runner, self.model = runner, runner.model
        self.block_size, self.max_model_len = runner.block_size, max_model_len
        self.splits: DecodeSplits = runner.decode_splits          # the rule eager decode steps use too
        self.sizes = self.splits.sizes
        self.inputs = GraphInputs(self.sizes[-1], -(-max_model_len // self.block_size), runner.device,
                                  self.splits.bucket)
        i = self.inputs
        self.ids, self.positions, self.slots, self.qsl = i.ids, i.positions, i.slots, i.qsl
        self.seq_lens, self.table = i.seq_lens, i.table
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def capture(cls, runner, max_model_len: int) -> "DecodeGraphs | None":
        if runner.attention_backend != "triton" or getattr(runner.model.rotary, "dynamic", False):
            logger.info("CUDA graphs off: attention backend %s%s", runner.attention_backend,
                        ", dynamic RoPE" if getattr(runner.model.rotary, "dynamic", False) else "")
            return None
        graphs = cls(runner, max_model_len)
        graphs._capture_all()
        return graphs

    def _meta(self, b: int) -> AttentionMetadata:
        cpu_qsl = torch.arange(b + 1, dtype=torch.int32)
        return AttentionMetadata(self.slots[:b], self.qsl[:b + 1], self.seq_lens[:b], self.table[:b], 1,
                                 self.max_model_len, self.block_size, cpu_qsl, torch.ones(b, dtype=torch.int32),
                                 "triton", num_splits=self.splits.for_bucket(b))

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.positions[:b], self.runner.kv_caches, self._meta(b))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)                                  # warm-up: compiles the Triton kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.1f MiB of graph memory",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.monotonic() - start, used / 2**20)

    def run(self, inputs) -> torch.Tensor | None:
        """The hidden states [B, D] of a decode-only step by replay, or None (run it eagerly)."""
        meta = inputs.attn
        n = meta.num_seqs
        if not meta.is_decode_only or n > self.sizes[-1] or meta.backend != "triton":
            return None
        b = self.prepare(inputs)
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def prepare(self, inputs) -> int:
        """The bucket b a decode step replays in, its rows in the static buffers: staged there already (every
        step of the engine, ``StepStaging.graph_inputs``), else copied (``load``). ``run`` replays bucket b next;
        a test on CPU runs ``_forward(b)`` instead (the captured kernels, no graph)."""
        return inputs.graph_bucket if self.inputs.holds(inputs) else self.load(inputs)

    def load(self, inputs) -> int:
        """Copy a decode step staged elsewhere into the static buffers, pad rows B..b; -> its bucket b."""
        meta = inputs.attn
        n = meta.num_seqs
        b = self.splits.bucket(n)
        nb = meta.block_table.shape[1]
        self.ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.table[:n, :nb].copy_(meta.block_table, non_blocking=True)
        if b > n:
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        return b
