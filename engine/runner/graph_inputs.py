"""The decode CUDA graphs' static inputs: one int32 device buffer that a decode step's staging copy lands in.

Built by ``DecodeGraphs`` (its static buffers are views of ``device``); ``StepStaging.stage`` hands it every decode
step it ``takes`` (decode-only, at most the largest bucket's rows), and ``stage`` packs the step into pinned host
memory laid out like the device buffer and sends it with ONE non-blocking copy. The graph then replays on the
buffers as they are: no device copy and no fill per step (``DecodeGraphs.prepare``); an eager step runs on the same
views.

    int32: | qsl Bmax+1 | ids Bmax | positions Bmax | slots Bmax | seq_lens Bmax | sample_rows Bmax | table Bmax x W |
            0, 1, 2, .. (written once)   <- one copy per step: ids .. row n-1 of the table (its first nb columns) ->

A step of n rows in bucket b writes rows :n of each region and pads rows n..b (slot -1: nothing written; seq_len
1) on the host; the padding rows' ids, positions and table entries keep an earlier step's (valid) values, as
the graph's padding always did. Two pinned buffers alternate, each with the event after its copy (as
``StepStaging._send``): packing one first waits until the device has read it. Regions start on 64-byte
boundaries. On CPU (tests) the host buffers are plain memory and the copy is synchronous.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pdserve.engine.runner.staging import StepInputs
from pdserve.kernels import AttentionMetadata

REGIONS = ("qsl", "ids", "positions", "slots", "seq_lens", "sample_rows", "table")
ALIGN = 16          # int32 elements: 64 bytes


class GraphInputs:
    def __init__(self, max_rows: int, width: int, device: torch.device, bucket_of: Callable[[int], int]):
        self.max_rows, self.width, self.device, self.bucket_of = max_rows, width, torch.device(device), bucket_of
        self.offsets, total = _layout(max_rows, width)
        self.device_buf = torch.zeros(total, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._host = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied: list = [None, None]
        self._turn = 0
        for host in self._host:
            views = self._views(host.numpy())
            views["qsl"][:] = np.arange(max_rows + 1)
            views["slots"][:] = -1
            views["seq_lens"][:] = 1
        self.device_buf.copy_(self._host[0])
        dev = self._views(self.device_buf)
        self.qsl, self.ids, self.positions, self.slots = dev["qsl"], dev["ids"], dev["positions"], dev["slots"]
        self.seq_lens, self.sample_rows, self.table = dev["seq_lens"], dev["sample_rows"], dev["table"]

    def takes(self, a) -> bool:
        """Whether ``a`` (``StepArrays``) is a decode step whose rows fit the buffers."""
        n = a.seq_lens.shape[0]
        return a.input_ids.shape[0] == n <= self.max_rows and a.block_table.shape[1] <= self.width

    def stage(self, a, sample_requests: list, block_size: int, backend: str):
        """Pack decode step ``a`` into the next host buffer, copy it into ``device_buf`` -> ``StepInputs`` whose
        tensors are views of the graphs' buffers, ``graph_bucket`` set."""
        n, nb, s = a.seq_lens.shape[0], a.block_table.shape[1], a.sample_rows.shape[0]
        bucket = self.bucket_of(n)
        host = self._next_host()
        self._pack(self._views(host.numpy()), a, n, bucket)
        lo, hi = self.offsets["ids"][0], self.offsets["table"][0] + (n - 1) * self.width + nb
        self.device_buf[lo:hi].copy_(host[lo:hi], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
        qsl_cpu, lens_cpu = torch.from_numpy(a.query_start_loc), torch.from_numpy(a.seq_lens)
        meta = AttentionMetadata(self.slots[:n], self.qsl[:n + 1], self.seq_lens[:n], self.table[:n], 1,
                                 int(a.seq_lens.max()), block_size, qsl_cpu, lens_cpu, backend)
        return StepInputs(self.ids[:n], self.positions[:n], meta, self.sample_rows[:s], sample_requests,
                          graph_bucket=bucket)

    def holds(self, inputs) -> bool:
        """Whether ``inputs`` were staged here (their ids are the buffers' own)."""
        return inputs.graph_bucket is not None and inputs.input_ids.data_ptr() == self.ids.data_ptr()

    def _next_host(self) -> torch.Tensor:
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()   # the device has read this buffer's previous step
        return self._host[self._turn]

    def _pack(self, h: dict, a, n: int, bucket: int) -> None:
        h["ids"][:n], h["positions"][:n], h["slots"][:n] = a.input_ids, a.positions, a.slot_mapping
        h["seq_lens"][:n], h["sample_rows"][:a.sample_rows.shape[0]] = a.seq_lens, a.sample_rows
        h["slots"][n:bucket], h["seq_lens"][n:bucket] = -1, 1                  # padding rows of the bucket
        h["table"][:n, :a.block_table.shape[1]] = a.block_table

    def _views(self, flat) -> dict:
        """{region: view} of ``flat`` (a numpy array or a tensor) in this layout; the table is [Bmax, W]."""
        views = {name: flat[off:off + size] for name, (off, size) in self.offsets.items()}
        views["table"] = views["table"].reshape(self.max_rows, self.width)
        return views


def _layout(max_rows: int, width: int) -> tuple[dict, int]:
    """{region: (offset, size)} and the total, each region on an ALIGN boundary."""
    sizes = dict(qsl=max_rows + 1, table=max_rows * width)
    offsets, off = {}, 0
    for name in REGIONS:
        size = sizes.get(name, max_rows)
        offsets[name] = (off, size)
        off += -(-size // ALIGN) * ALIGN
    return offsets, off
