"""Typed messages between the API process and the engine-core process (msgspec msgpack; never pickle).

    API ──stdin──> core            StartCore (4-byte big-endian length + msgpack), once; stdin then stays open
                                   as the core's lifeline (EOF: the API process is gone)
    core ──Hello──> API            first on each of the core's two sockets: the token StartCore carried; the API
                                   process takes nothing from, and sends nothing to, a connection without it
    API ──"down" ROUTER──> DEALER  AddRequest | AbortRequests | StopRequests | Shutdown, sent as they come; the
                                   core applies all that arrived as one batch before each step
    core DEALER ──"up" ROUTER──>   Ready once, then one CoreOutputs per step (deltas of every request that
                                   moved: token ids, no text; requests refused at add, stats at most every
                                   STATS_INTERVAL_S),
                                   a Heartbeat every HEARTBEAT_S from a thread of its own (also while a long
                                   step runs), and Fatal before the core exits on an unrecoverable error

Each AddRequest carries ``seq``, unique per add in the API process; the core echoes it in every
CoreOutput and Rejected of that request. A request id reused right after its abort is then told apart
from the aborted incarnation, whose last outputs may still be on their way: the client drops them.
The engine itself still keys requests by ``request_id`` (it refuses an id that is still live).

Text is the API process's (``output_processor``): it detokenizes the token ids and finds stop strings;
one that ends a request the core still runs becomes a ``StopRequests``: the core finishes the request as
stopped (its blocks freed) and sends its final output, tokens-free, with the KV accounting / transfer
params a stop found in the core would have carried.

The API process binds both ipc sockets, in a 0700 directory of its own, and the core connects
(``channel.py``: who may connect, the token, what is dropped). A frame that does not decode, on either side,
is dropped, logged and counted, never fatal (``decode_client_message`` / ``decode_core_message`` raise
``ValueError``; the channel catches it).
"""

from __future__ import annotations

import struct

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.kv_transfer import KVTransferParams
from pdserve.engine.outputs import EngineStats, PromptLogprob, RequestOutput, RequestTimes
from pdserve.engine.runner.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams

VERSION = 9                       # 9: CoreOutput.step_time; 8: CoreOutput.times, EngineStats: preemptions, ...
STATS_INTERVAL_S = 0.1            # stats ride along with outputs at most this often (and whenever idle)
HEARTBEAT_S = 0.5                 # the core says it is alive this often, whatever its loop is doing
_LENGTH = struct.Struct(">I")


class StartCore(msgspec.Struct, frozen=True):
    config: EngineConfig
    down_address: str              # ipc://<0700 dir>/down, bound by the API process: the core's inbox
    up_address: str                # ipc://<0700 dir>/up, bound by the API process: the core's outbox
    token: bytes                   # the core's Hello on both sockets carries it (never logged: see __repr__)
    version: int = VERSION

    def __repr__(self) -> str:
        return f"StartCore(down_address={self.down_address!r}, up_address={self.up_address!r}, token=<hidden>)"


class Hello(msgspec.Struct, frozen=True, tag=True):
    """The core's first frame on each socket: it proves the sender is the process StartCore went to."""
    token: bytes
    version: int = VERSION


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    seq: int                       # this add's number (see the module docstring)
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None
    first_token_stop: str | None = None   # the prefill node's token completes this stop string: end it at add
    cache_salt: str | None = None         # the request's prefix-cache / store-key salt (``Request.cache_salt``)
    version: int = VERSION


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]
    version: int = VERSION


class StopRequests(msgspec.Struct, frozen=True, tag=True):
    """The API process found a stop string in each request: ``stop_strings[i]`` ends ``request_ids[i]``."""
    request_ids: list[str]
    stop_strings: list[str]
    version: int = VERSION


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    reason: str = ""
    version: int = VERSION


class StoreInfo(msgspec.Struct, frozen=True):
    """What a decode node checks a prefill node's ``kv_transfer_params`` against (``StoreConnector.check``)."""
    fingerprint: str
    block_size: int
    chunk_tokens: int
    kv_layout: str
    num_layers: int = 0              # the model's layers: a chunk is stored when all of them are (the proxy's lookup)


class Ready(msgspec.Struct, frozen=True, tag=True):
    pid: int
    max_model_len: int
    num_blocks: int
    stats: EngineStats
    store: StoreInfo | None = None   # None: the core has no KV store
    kv_events: str = ""              # the core's KV-event endpoint (``--kv-events-port``); "": none
    kv_replay: str = ""              # its replay socket (``engine.kv.kv_replay``); "": none
    version: int = VERSION


class Sample(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


class CoreOutput(msgspec.Struct, frozen=True, array_like=True):
    """``RequestOutput`` on the wire, with its add's ``seq``; no text (the API process detokenizes)."""
    request_id: str
    seq: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[Sample] | None = None
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    kv_accounting: dict[str, int] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    times: RequestTimes | None = None     # the core's timestamps: with the first sampled token and the final output
    step_time: float = 0.0                # when the core made this output (time.monotonic()): vLLM's ITL clock


class Rejected(msgspec.Struct, frozen=True, array_like=True):
    """``LLMEngine.add_request`` raised ``error_type(message)``: ``invalid`` for a ValueError (the client's
    fault: HTTP 400)."""
    request_id: str
    seq: int
    error_type: str
    message: str
    invalid: bool


class CoreOutputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[CoreOutput] = []
    rejected: list[Rejected] = []
    stats: EngineStats | None = None
    version: int = VERSION


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """The core process is alive (sent even while a step runs); silence past --rank-timeout: it hangs."""
    version: int = VERSION


class Fatal(msgspec.Struct, frozen=True, tag=True):
    message: str
    version: int = VERSION


ClientMessage = AddRequest | AbortRequests | StopRequests | Shutdown
CoreMessage = Ready | CoreOutputs | Heartbeat | Fatal
_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_core_decoder = msgspec.msgpack.Decoder(CoreMessage)
_start_decoder = msgspec.msgpack.Decoder(StartCore)
_hello_decoder = msgspec.msgpack.Decoder(Hello)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_client_message(data: bytes) -> ClientMessage:
    return _check(_client_decoder.decode(data))


def decode_core_message(data: bytes) -> CoreMessage:
    return _check(_core_decoder.decode(data))


def decode_hello(data: bytes) -> Hello:
    return _check(_hello_decoder.decode(data))


def write_start(stream, start: StartCore) -> None:
    data = encode(start)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_start(stream) -> StartCore:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the API process closed stdin before sending StartCore")
    return _check(_start_decoder.decode(stream.read(_LENGTH.unpack(header)[0])))


def output_to_wire(out: RequestOutput, seq: int) -> CoreOutput:
    logprobs = None if out.logprobs is None else [Sample(s.token_id, s.logprob, s.top_logprobs) for s in out.logprobs]
    transfer = None if out.kv_transfer_params is None else KVTransferParams.from_json_obj(out.kv_transfer_params)
    return CoreOutput(out.request_id, seq, out.new_token_ids, out.finished, out.finish_reason,
                      out.num_prompt_tokens, out.num_cached_tokens, logprobs, out.error, transfer, out.kv_accounting,
                      out.stop_reason, out.prompt_logprobs, out.times, out.step_time)


def output_from_wire(o: CoreOutput) -> RequestOutput:
    """The ``RequestOutput`` of ``o``, text empty (``output_processor`` fills it in)."""
    logprobs = None if o.logprobs is None else [SampleResult(s.token_id, s.logprob, s.top_logprobs)
                                                 for s in o.logprobs]
    transfer = None if o.kv_transfer_params is None else o.kv_transfer_params.to_json_obj()
    return RequestOutput(o.request_id, o.new_token_ids, "", o.finished, o.finish_reason, o.num_prompt_tokens,
                         o.num_cached_tokens, logprobs, o.error, transfer, o.kv_accounting, o.stop_reason,
                         o.prompt_logprobs, o.times, o.step_time)


def _check(message):
    if message.version != VERSION:
        raise ValueError(f"engine-core message version {message.version}; this build speaks {VERSION} "
                         f"(mixed pdserve versions?)")
    return message
