"""Typed messages between the driver and the worker ranks (msgspec; never pickle).

    driver ──StepMessage──> every rank (broadcast.MessageQueue)            once per engine step
    last stage, tp rank 0 ──StepResult──> driver (a MessageQueue with one reader)
    driver ──KVGather / KVScatter──> every rank (the same broadcast queue)  KV publish / load
    each rank ──KVPart──> driver (one MessageQueue per rank)
    launcher on another machine ──HeartbeatMirror──> driver (every 0.1 s)
    driver ──WorkerSpec──> every rank, through the rendezvous store, once at start-up

A ``StepMessage`` carries what a rank needs to build its model inputs without the scheduler's
``Request`` objects: per scheduled request the token ids it computes, the first position, the
block table and (when it samples) its sampling parameters.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.sampling_params import SamplingParams

VERSION = 2                     # 2: StepRequest.outputs, SamplingParams penalties + logit_bias


class StepRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_ids: list[int]            # tokens [start, start + n) to compute this step
    start: int                      # their first position (== tokens already in the KV cache)
    block_ids: list[int]            # block table covering positions [0, start + n)
    sample: bool                    # the chunk ends at the request's last token: sample one
    params: SamplingParams | None = None     # set when sample
    history: list[int] | None = None         # all token ids, only when repetition_penalty != 1
    banned: list[int] = []                   # ids it may not sample now (eos / stop ids before min_tokens)
    sampler_draws: int = 0                   # draws its seeded generator made on the prefill node
    outputs: list[int] | None = None         # its generated token ids, only when presence / frequency penalised
    bitmask: bytes | None = None             # its structured-output row: int32 words, bit j = token j allowed


class Tensor(msgspec.Struct, frozen=True, array_like=True):
    """Raw bytes + dtype + shape (CPU, contiguous); see ``kv.to_wire`` / ``kv.from_wire``."""
    dtype: str
    shape: list[int]
    data: bytes


class KVGather(msgspec.Struct, frozen=True, tag=True):
    """Every rank: copy its layers and KV heads at ``slots`` out of its cache and send them back (publish)."""
    op_id: int
    slots: list[int]                # [n] flat cache slots of the chunk's tokens
    version: int = VERSION


class KVScatter(msgspec.Struct, frozen=True, tag=True):
    """Every rank: write its layers and KV heads of ``data`` at ``slots`` (load), then acknowledge."""
    op_id: int
    slots: list[int]
    data: Tensor                    # [L, C, n, Hkv, D]: every layer and KV head of the chunk
    version: int = VERSION


class KVPart(msgspec.Struct, frozen=True):
    """A rank's answer to a KV op on its own queue: its share of a gather, or an empty scatter ack."""
    op_id: int
    rank: int
    first_layer: int
    data: Tensor | None = None      # gather: [L_rank, C, n, Hkv_rank, D]
    error: str = ""
    version: int = VERSION


class StepMessage(msgspec.Struct, frozen=True, tag=True):
    step: int
    requests: list[StepRequest] = []
    released: list[str] = []        # requests that finished or were aborted: drop their sampler state
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
    kv_parts: list[dict]            # per rank: the handle of its KV answer queue (rank -> driver)
    heartbeat_mirror: dict          # inbound queue for other machines' heartbeat records (HeartbeatMirror)
    local_ranks: list[int]          # ranks on the driver's machine (they read the ring)
    rank_timeout: float
    debug_sync: bool = False
    attention_backend: str | None = None   # --attention-backend (None: the env variable, else cpu or torch on a CPU)
    device: str = "cpu"             # the engine's resolved --device: cpu | cuda (parallel/devices.py picks the GPU)
    dist_backend: str = "auto"      # --dist-backend
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enforce_eager: bool = False     # --enforce-eager: no decode graphs on any rank (parallel/graphs.py)
    version: int = VERSION


class HeartbeatMirror(msgspec.Struct, frozen=True, array_like=True):
    """A remote launcher's copy of its ranks' heartbeat records, sent every 0.1 s (ages, not clocks)."""
    node_rank: int
    records: list[list[int]]        # [rank, step, phase, seq, age_ns, pid, exit, stopped]
    version: int = VERSION


DriverMessage = StepMessage | KVGather | KVScatter | Shutdown
_encoder = msgspec.msgpack.Encoder()
_driver_decoder = msgspec.msgpack.Decoder(DriverMessage)
_result_decoder = msgspec.msgpack.Decoder(StepResult)
_part_decoder = msgspec.msgpack.Decoder(KVPart)
_mirror_decoder = msgspec.msgpack.Decoder(HeartbeatMirror)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_driver_message(data: bytes) -> DriverMessage:
    return _check(_driver_decoder.decode(data))


def decode_part(data: bytes) -> KVPart:
    return _check(_part_decoder.decode(data))


def decode_mirror(data: bytes) -> HeartbeatMirror:
    return _check(_mirror_decoder.decode(data))


def decode_result(data: bytes) -> StepResult:
    return _check(_result_decoder.decode(data))


def _check(message):
    if message.version != VERSION:
        raise ValueError(f"message version {message.version}; this build speaks {VERSION} (mixed pdserve versions?)")
    return message


def micro_batches(requests: list[StepRequest], n: int) -> list[list[StepRequest]]:
    """Up to ``n`` contiguous groups with about equal token counts (never an empty group).

    Before each request: cut if that lands nearer the next group's token target than after it, or if
    only one request per group still to open is left."""
    n = max(1, min(n, len(requests)))
    total = sum(len(r.token_ids) for r in requests)
    groups, current, done = [], [], 0
    for i, r in enumerate(requests):
        size, to_open, target = len(r.token_ids), n - len(groups) - 1, total * (len(groups) + 1) / n
        if current and to_open and (len(requests) - i == to_open or abs(done - target) <= abs(done + size - target)):
            groups.append(current)
            current = []
        current.append(r)
        done += size
    groups.append(current)
    return groups
