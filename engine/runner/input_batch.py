"""Turn one step's scheduled requests into flat model inputs and attention metadata (no model calls here).

Called by ``ModelRunner.execute`` once per step (``InputBatch.prepare``) and by a tp/pp worker rank
for its micro-batches (``build_step_inputs``, stateless: the step message carries the rows).

Per-request state lives in preallocated arrays, one row per running request (vLLM's InputBatch):

    token_ids    [rows, capacity] int64   every token the request has (prompt + outputs), appended
    block_table  [rows, max_blocks] int32 its block ids, appended as the block manager grows them
    rows         request_id -> row; a finished, aborted or preempted request gives its row back
    output_counts  [rows, V] counts of the generated tokens of rows whose request has a presence or
                 frequency penalty (``output_counts.py``), noted as the tokens are appended

A step reads O(new tokens + new blocks) per scheduled request from Python objects and cuts the rest
out of the arrays with numpy:

    request b computes tokens [start_b, start_b + n_b) at positions start_b.. ; its K/V goes to slot
    block_table[row_b, p // block_size] * block_size + p % block_size; it is sampled this step iff
    start_b + n_b == its number of tokens.

The step's integers travel to the device as one int32 buffer in pinned memory, one non-blocking copy
(``staging.py``); on CPU the tensors are views of the numpy arrays (no copy).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.runner.output_counts import OutputCounts
from pdserve.engine.runner.staging import StepArrays, StepInputs, StepStaging


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 backend: str = "torch"):
        self.block_size, self.backend = block_size, backend
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int64)
        self.token_ids = np.zeros((max_num_seqs, min(max_model_len, 1024)), np.int64)
        self.num_tokens = np.zeros(max_num_seqs, np.int64)
        self.rows: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self.staging = StepStaging(device)
        self.output_counts = OutputCounts(device)

    def remove(self, request_id: str) -> None:
        """Give the request's row back (finished, aborted or preempted: its blocks are gone)."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = self.num_tokens[row] = 0
            self.output_counts.clear(row)
            self._free.append(row)

    def prepare(self, scheduled) -> StepInputs:
        """scheduled: ``ScheduledRequest``s (request, num_new_tokens) in row order -> the step's inputs."""
        b = len(scheduled)
        rows, starts, q_lens = np.empty(b, np.int64), np.empty(b, np.int64), np.empty(b, np.int64)
        samples, sample_requests = np.zeros(b, bool), []
        for i, item in enumerate(scheduled):
            req, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            rows[i], starts[i], q_lens[i] = self._sync(req, start + n), start, n
            if start + n == req.num_tokens:
                samples[i] = True
                sample_requests.append(req)
        arrays = _step_arrays(starts, q_lens, samples, self.block_size,
                              lambda req_idx, pos: self.token_ids[rows[req_idx], pos],
                              lambda nb: self.block_table[rows, :nb],
                              lambda req_idx, pos: self.block_table[rows[req_idx], pos // self.block_size])
        return self.staging.stage(arrays, sample_requests, self.block_size, self.backend)

    def _sync(self, req, upto: int) -> int:
        """Append the request's tokens [.., upto) and the blocks covering them to its row; -> the row."""
        row = self.rows.get(req.request_id)
        if row is None:
            row = self.rows[req.request_id] = self._take_row()
        have = int(self.num_tokens[row])
        if upto > have:
            self._fit_tokens(upto)
            self.token_ids[row, have:upto] = req.all_token_ids[have:upto]
            self.num_tokens[row] = upto
            if req.sampling_params.penalised and upto > req.num_prompt_tokens:
                self.output_counts.note(row, self.token_ids[row, max(have, req.num_prompt_tokens):upto])
        nb, held = -(-upto // self.block_size), int(self.num_blocks[row])
        if held and (held > len(req.block_ids) or self.block_table[row, held - 1] != req.block_ids[held - 1]):
            held = 0                            # its blocks were replaced without a remove(): rewrite the row
        if nb > held:
            if nb > len(req.block_ids):
                raise RuntimeError(f"request {req.request_id!r} computes up to token {upto} but holds only "
                                   f"{len(req.block_ids)} blocks of {self.block_size}")
            self.block_table[row, held:nb] = req.block_ids[held:nb]
            self.num_blocks[row] = nb
        return row

    def _take_row(self) -> int:
        if not self._free:                      # more live requests than --max-num-seqs rows: grow
            n = self.block_table.shape[0]
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(n, np.int64)])
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros(n, np.int64)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _fit_tokens(self, upto: int) -> None:
        cap = self.token_ids.shape[1]
        if upto > cap:
            grown = np.zeros((self.token_ids.shape[0], min(max(2 * cap, upto), max(self.max_model_len, upto))),
                             np.int64)
            grown[:, :cap] = self.token_ids
            self.token_ids = grown


def build_step_inputs(items, block_size: int, device: torch.device | None = None,
                      backend: str = "torch", staging: StepStaging | None = None) -> StepInputs:
    """Stateless: ``items`` carry ``request`` (token ids [start, start + n) and a full block table)
    and ``num_new_tokens``, as a tp/pp worker's step message does. ``staging``: a rank's own (its decode graphs'
    ``GraphInputs`` set: a decode step lands straight in their buffers), else a new one per call."""
    reqs = [it.request for it in items]
    starts = np.array([r.num_computed_tokens for r in reqs], np.int64)
    q_lens = np.array([it.num_new_tokens for it in items], np.int64)
    samples = np.array([s + n == r.num_tokens for s, n, r in zip(starts, q_lens, reqs)], bool)
    ids = np.array([t for r, s, n in zip(reqs, starts, q_lens) for t in r.all_token_ids[s:s + n]], np.int64)
    nb = max(-(-(int(s) + int(n)) // block_size) for s, n in zip(starts, q_lens))
    table = np.zeros((len(reqs), nb), np.int32)
    for i, (r, s, n) in enumerate(zip(reqs, starts, q_lens)):
        k = -(-(int(s) + int(n)) // block_size)
        table[i, :k] = r.block_ids[:k]
    arrays = _step_arrays(starts, q_lens, samples, block_size, lambda req_idx, pos: ids,
                          lambda nb_: table[:, :nb_], lambda req_idx, pos: table[req_idx, pos // block_size])
    staging = staging or StepStaging(device or torch.device("cpu"))
    return staging.stage(arrays, [r for r, s in zip(reqs, samples) if s], block_size, backend)


def _step_arrays(starts, q_lens, samples, block_size, token_ids_at, table_rows, block_at) -> StepArrays:
    """Vectorised: positions, token ids, slots and the step's block table from per-sequence arrays."""
    b = len(starts)
    qsl = np.zeros(b + 1, np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    total = int(qsl[-1])
    req_idx = np.repeat(np.arange(b), q_lens)                                  # [T]
    positions = starts[req_idx] + (np.arange(total) - qsl[:-1][req_idx])       # [T]
    seq_lens = (starts + q_lens).astype(np.int32)
    slots = block_at(req_idx, positions).astype(np.int64) * block_size + positions % block_size
    nb = -(-int(seq_lens.max()) // block_size)
    return StepArrays(input_ids=token_ids_at(req_idx, positions), positions=positions, slot_mapping=slots,
                      query_start_loc=qsl, seq_lens=seq_lens, block_table=table_rows(nb),
                      sample_rows=(qsl[1:][samples] - 1).astype(np.int64))
