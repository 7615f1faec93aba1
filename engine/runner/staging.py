"""Move one step's host arrays (``StepArrays``, cut by the input batch) to the model's device as ``StepInputs``.

Called by the input batch once per step. A decode step the CUDA graphs can replay goes to ``graph_inputs``
(``graph_inputs.py``, set by the runner once the graphs are captured): one copy straight into the graphs' static
buffers. Otherwise, on CPU the tensors are views of the numpy arrays. On CUDA every integer of the step (token
ids, positions, slots, query starts, sequence lengths, sampled rows, the block table) is packed into one int32
buffer in pinned memory and sent with ONE non-blocking copy into a device buffer; the step's tensors are views of
that device buffer. Two pinned buffers alternate, each with an event recorded after its copy: packing into a
buffer first waits for that event, so a step that samples nothing (a long prompt's middle chunks: no host sync at
all) can never overwrite inputs whose copy the device has not made yet.

    pinned int32: | ids T | positions T | slots T | qsl B+1 | seq_lens B | sample_rows S | table B*nb |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int32/int64
    positions: torch.Tensor        # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor      # [S]: flat row whose logits are sampled
    sample_requests: list          # [S] Request objects, aligned with sample_rows
    graph_bucket: int | None = None   # staged into the decode graphs' buffers, padded to this bucket


@dataclass
class StepArrays:
    """A step on the host, before it is staged: every array is numpy."""
    input_ids: np.ndarray          # [T] int64
    positions: np.ndarray          # [T] int64
    slot_mapping: np.ndarray       # [T] int64
    query_start_loc: np.ndarray    # [B + 1] int32
    seq_lens: np.ndarray           # [B] int32
    block_table: np.ndarray        # [B, nb] int32
    sample_rows: np.ndarray        # [S] int64


class StepStaging:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pinned: list[torch.Tensor] = []
        self._copied: list = [None, None]          # per pinned buffer: the event after its last copy
        self._device_buf: torch.Tensor | None = None
        self._turn = 0
        self.graph_inputs = None                   # GraphInputs of the decode CUDA graphs, once captured

    def stage(self, a, sample_requests: list, block_size: int, backend: str):
        if self.graph_inputs is not None and backend == "triton" and self.graph_inputs.takes(a):
            return self.graph_inputs.stage(a, sample_requests, block_size, backend)
        qsl_cpu, lens_cpu = torch.from_numpy(a.query_start_loc), torch.from_numpy(a.seq_lens)
        max_q = int((a.query_start_loc[1:] - a.query_start_loc[:-1]).max())
        if self.device.type == "cpu":
            t = torch.from_numpy
            meta = AttentionMetadata(t(a.slot_mapping), qsl_cpu, lens_cpu, t(a.block_table), max_q,
                                     int(a.seq_lens.max()), block_size, qsl_cpu, lens_cpu, backend)
            return StepInputs(t(a.input_ids), t(a.positions), meta, t(a.sample_rows), sample_requests)
        parts = [a.input_ids, a.positions, a.slot_mapping, a.query_start_loc, a.seq_lens, a.sample_rows,
                 a.block_table.reshape(-1)]
        dev = self._send(parts)
        views, off = [], 0
        for p in parts:
            views.append(dev[off:off + p.size])
            off += p.size
        ids, pos, slots, qsl, lens, sample_rows, table = views
        meta = AttentionMetadata(slots, qsl, lens, table.view(a.block_table.shape), max_q, int(a.seq_lens.max()),
                                 block_size, qsl_cpu, lens_cpu, backend)
        return StepInputs(ids, pos, meta, sample_rows, sample_requests)

    def _send(self, parts: list[np.ndarray]) -> torch.Tensor:
        """Pack ``parts`` into the next pinned buffer and copy it to the device buffer (non-blocking)."""
        n = sum(p.size for p in parts)
        self._turn ^= 1
        if len(self._pinned) < 2 or self._pinned[self._turn].numel() < n:
            cap = max(n, 2 * (self._pinned[self._turn].numel() if len(self._pinned) == 2 else 4096))
            buf = torch.empty(cap, dtype=torch.int32, pin_memory=True)
            if len(self._pinned) < 2:
                self._pinned = [buf, torch.empty(cap, dtype=torch.int32, pin_memory=True)]
            else:
                self._pinned[self._turn] = buf
            if self._device_buf is None or self._device_buf.numel() < cap:
                self._device_buf = torch.empty(cap, dtype=torch.int32, device=self.device)
        host = self._pinned[self._turn]
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()   # the device has read this buffer's previous step
        np.concatenate(parts, out=host.numpy()[:n], casting="unsafe")
        dev = self._device_buf[:n]
        dev.copy_(host[:n], non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        return dev
