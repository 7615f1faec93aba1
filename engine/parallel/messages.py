"""Typed messages between the driver and the worker ranks (msgspec; never pickle).

    driver ──StepMessage──> every rank (broadcast.MessageQueue)            once per engine step
    last stage, tp rank 0 ──StepResult──> driver (a MessageQueue with one reader)
    driver ──WorkerSpec──> every rank, through the rendezvous store, once at start-up

A ``StepMessage`` carries what a rank needs to build its model inputs without the scheduler's
``Request`` objects: per scheduled request the token ids it computes, the first position, the
block table and (when it samples) its sampling parameters.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.sampling_params import SamplingParams

VERSION = 1


class StepRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_ids: list[int]            # tokens [start, start + n) to compute this step
    start: int                      # their first position (== tokens already in the KV cache)
    block_ids: list[int]            # block table covering positions [0, start + n)
    sample: bool                    # the chunk ends at the request's last token: sample one
    params: SamplingParams | None = None     # set when sample
    history: list[int] | None = None         # all token ids, only when repetition_penalty != 1


class KVChunkOp(msgspec.Struct, frozen=True, array_like=True):
    """Copy one (chunk, layer range) between this node's paged cache and the KV store, per rank."""
    op_id: int
    chunk_key: str
    slots: list[int]                # flat cache slots of the chunk's tokens [a, b)
    offset: int = 0                 # load: first token of the object to copy (a - chunk start)
    length: int = 0                 # load: tokens in the stored object


class StepMessage(msgspec.Struct, frozen=True, tag=True):
    step: int
    requests: list[StepRequest] = []
    released: list[str] = []        # requests that finished or were aborted: drop their sampler state
    kv_saves: list[KVChunkOp] = []  # before the forward pass: nothing; after it: gather + put (see stage.py)
    kv_loads: list[KVChunkOp] = []  # before the forward pass: get + scatter
    version: int = VERSION


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    reason: str = ""
    version: int = VERSION


class SampledToken(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


class StepResult(msgspec.Struct, frozen=True):
    step: int
    tokens: list[SampledToken] = []
    kv_loaded: dict[int, bool] = {}   # load op id -> every layer of this rank loaded (AND over ranks by the driver)
    version: int = VERSION


class WorkerSpec(msgspec.Struct, frozen=True):
    """What every rank needs at start-up (published by the driver in the rendezvous store)."""
    model: str
    dtype: str
    seed: int
    tp: int
    pp: int
    num_blocks: int
    block_size: int
    broadcast: dict                 # broadcast.QueueHandle as a dict
    results: dict                   # the result queue's handle
    heartbeat: str                  # watchdog.Heartbeat file
    local_ranks: list[int]          # ranks that read the ring (the driver's machine)
    rank_timeout: float
    debug_sync: bool = False
    kv_store: str | None = None     # store URL for per-rank KV publish/load ("" / None: none)
    version: int = VERSION


DRIVER_MESSAGE = StepMessage | Shutdown
_encoder = msgspec.msgpack.Encoder()
_driver_decoder = msgspec.msgpack.Decoder(DRIVER_MESSAGE)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_driver_message(data: bytes) -> StepMessage | Shutdown:
    return _check(_driver_decoder.decode(data))


def decode_result(data: bytes) -> StepResult:
    return _check(_result_decoder.decode(data))


def _check(message):
    if message.version != VERSION:
        raise ValueError(f"message version {message.version}; this build speaks {VERSION} (mixed pdserve versions?)")
    return message
