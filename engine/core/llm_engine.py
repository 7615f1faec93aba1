"""The synchronous engine core: requests in, one scheduled model step at a time, deltas out.

Used by ``LLM`` (offline) and by ``AsyncEngine`` (the HTTP node, from its engine thread):

    engine.add_request(id, prompt_token_ids, params[, kv_transfer_params][, cache_salt=...])
    while engine.has_unfinished():
        for delta in engine.step(): ...   # schedule -> bitmask -> run model + sample -> publish KV -> update -> text
    engine.abort_request(id)              # at any point; frees the request's blocks
    engine.stop_request(id, stop_string)  # detokenize=False: the caller found a stop string (frees blocks too)

A request with a structured-output constraint (``SamplingParams.structured``) has its grammar compiled off
this loop by ``structured.StructuredOutputManager`` (it waits in WAITING_FOR_GRAMMAR meanwhile); each step the
manager fills the step's token bitmask before the model runs and the runner masks the logits with it.

With a KV store attached (``--role prefill|decode``, or ``both`` with ``--kv-store``) the
``StoreConnector`` loads prompt KV before prefill and publishes it after (its store lookups run off this
thread: a step waits for them only when nothing else runs, ``_await_lookups``); a finished request that
is still publishing is held back until the store acknowledged it (see ``outputs.OutputAssembler``).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import numbers
import time
import weakref

import torch

from pdserve.engine import host_memory
from pdserve.engine.config import ConfigError, EngineConfig, EngineRuntime
from pdserve.engine.core.output_assembler import OutputAssembler
from pdserve.engine.kv.kv_transfer import KVTransferParams, check_transfer
from pdserve.engine.kv.store_factory import build_node_store, object_bytes
from pdserve.engine.models.layers import matmul_path
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.outputs import ITERATION_TOKEN_BUCKETS, RequestOutput
from pdserve.engine.runner.model_runner import ModelRunner, SampleFailure
from pdserve.engine.sched.block_manager import BlockManager
from pdserve.engine.sched.request import Request, check_stop
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.structured.compiler import GrammarCompiler, tokenizer_info
from pdserve.engine.structured.manager import StructuredOutputManager
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.kernels import resolve_backend

logger = logging.getLogger(__name__)
LOOKUP_WAIT_S = 0.1     # idle engine: longest wait per step for a store lookup's answer. A store that is up
                        # answers in well under 1 ms (the wait ends then); a contended host can delay the lookup
                        # thread by tens of ms, and the request would miss the step. Only while a store does not
                        # answer is it spent whole: AsyncEngine's adds and aborts wait as long, no stream does
                        # (nothing runs). The lookup's own bound is the store client's timeout.


class PromptTooLongError(ValueError):
    """The prompt (plus the tokens asked for) does not fit ``--max-model-len``."""


class LLMEngine:
    def __init__(self, config: EngineConfig, store=None, detokenize: bool = True):
        """``store``: a ``KVStore`` to use instead of building one from ``config.kv_transfer``.
        ``detokenize`` False: outputs carry token ids only and stop strings are the caller's (the
        engine-core process: its API process detokenizes and calls ``stop_request``), and no tokenizer is
        loaded (``tokenizer`` None: ~1.5 s of start-up, transformers' config imports, saved)."""
        torch.set_num_threads(config.num_threads)
        host_memory.tune()                                  # freed activations stay mapped (glibc)
        torch.manual_seed(config.seed)
        self.config = config
        self.model, self.model_config = _load(config)      # model None: tp x pp worker ranks hold it
        self.tokenizer = load_tokenizer(config.model) if detokenize else None   # the core process has none
        self.layout = self.model_config.kv_layout()
        self.runtime = _measure_runtime(config, self.model_config, self.layout)
        block_size = config.cache.block_size
        self.block_manager = BlockManager(self.runtime.num_blocks, block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        self.runner = self._build_runner()
        self.kv_events = self._build_kv_events()
        self.store, self.connector = self._build_connector(store)
        if self.connector is not None:   # an engine dropped without shutdown() must not keep its cache alive
            weakref.finalize(self, _release, self.connector, self.store if self._owns_store else None)
        self.structured = self._build_structured()
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, self.runtime.max_model_len, self.connector,
                                   grammars=self.structured)
        self.outputs = OutputAssembler(self.tokenizer if detokenize else None, self.scheduler, self.runner,
                                       self.connector, config.kv_transfer.role)
        self.iterations = IterationTokens()
        logger.info("engine ready: model=%s role=%s dtype=%s blocks=%d x %d tokens (%.1f MiB KV) "
                    "max_model_len=%d store=%s attention=%s matmuls=%s", config.model_name, config.kv_transfer.role,
                    self.layout.dtype, self.runtime.num_blocks, block_size,
                    self.runtime.num_blocks * self.runtime.bytes_per_block / 2**20, self.runtime.max_model_len,
                    config.kv_transfer.store_url,
                    self._attention_backend(),
                    matmul_path(self.layout.dtype, config.resolved_device, config.compiles_model))

    def _attention_backend(self) -> str:
        """The runner's; tp x pp ranks resolve theirs the same way (same flag, env and device)."""
        ex = self.config.execution
        return getattr(self.runner, "attention_backend", None) or resolve_backend(ex.attention_backend,
                                                                                  self.config.resolved_device)

    def _build_runner(self):
        """``ModelRunner`` in this process, or the ``ParallelExecutor`` of tp x pp worker processes."""
        if self.model is not None:
            return ModelRunner(self.model, self.layout, self.runtime.num_blocks, self.config.cache.block_size,
                               device=self.config.resolved_device, max_num_seqs=self.config.scheduler.max_num_seqs,
                               max_model_len=self.runtime.max_model_len,
                               attention_backend=self.config.execution.attention_backend,
                               enforce_eager=self.config.execution.enforce_eager,
                               torch_compile=self.config.compiles_model)
        from pdserve.engine.parallel.executor import ParallelExecutor

        return ParallelExecutor(self.config, self.model_config, self.runtime.num_blocks)

    def _build_structured(self) -> StructuredOutputManager:
        """Grammars compile against the tokenizer's vocabulary, padded to the logits' width and ending at the
        engine's eos ids; the engine-core process (no tokenizer) loads it in the first compile."""
        model_dir, vocab, eos = self.config.model, self.model_config.vocab_size, self.model_config.eos_token_ids
        tokenizer = self.tokenizer
        compiler = GrammarCompiler(lambda: tokenizer_info(model_dir, vocab, eos, tokenizer))
        return StructuredOutputManager(compiler, vocab)

    def _build_kv_events(self):
        """The KV-event publisher (``--kv-events-port``), or None; the block manager records for it."""
        kv = self.config.kv_transfer
        if kv.kv_events_port is None:
            return None
        from pdserve.engine.kv.kv_events import KVEventPublisher

        self.block_manager.events = []
        return KVEventPublisher(kv.kv_auth_token, kv.kv_events_port)

    def store_info(self):
        """What the node tells about its KV (``core.messages.StoreInfo``), None without a store."""
        from pdserve.engine.core.messages import StoreInfo

        c = self.connector
        if c is None:
            return None
        return StoreInfo(fingerprint=c.fingerprint, block_size=c.block_size, chunk_tokens=c.chunk_tokens,
                         kv_layout=c.layout_text, num_layers=self.model_config.num_layers)

    @property
    def kv_events_endpoint(self) -> str:
        return "" if self.kv_events is None else self.kv_events.endpoint

    @property
    def kv_replay_endpoint(self) -> str:
        return "" if self.kv_events is None else self.kv_events.replay_endpoint

    def shutdown(self) -> None:
        """Stop the KV publisher/loader, close a store this engine built (detaching from a daemon),
        then stop the worker ranks of a tp x pp engine. Idempotent."""
        self.structured.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.connector is not None:
            self.connector.shutdown()
        if self.store is not None and self._owns_store:
            self.store.close()
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    def _build_connector(self, store):
        self._owns_store = store is None
        kv = self.config.kv_transfer
        store = store if store is not None else build_node_store(kv, object_bytes(self.layout, kv.kv_chunk_tokens))
        if store is None:
            return None, None
        from pdserve.engine.kv.kv_connector import StoreConnector

        return store, StoreConnector(store, self.model_config, self.layout, self.runner.kv_caches,
                                     self.config.cache.block_size, kv.kv_chunk_tokens, kv.role,
                                     kv.cluster_key().seal_key, kv_io=getattr(self.runner, "kv_io", None),
                                     publish_buffer_bytes=kv.kv_publish_buffer_bytes,
                                     load_layerwise=kv.kv_load_layerwise,
                                     load_layerwise_timeout_s=kv.kv_load_layerwise_timeout_s,
                                     publish_layerwise=kv.kv_publish_layerwise)

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_prompt_fits(num_prompt_tokens, max_tokens, self.max_model_len)

    def check_transfer(self, kv_transfer_params: dict | None) -> None:
        """Raise ``TransferMismatchError`` if this node cannot use the prefill node's KV (thread-safe)."""
        check_transfer(kv_transfer_params, self.model_config.vocab_size,
                       None if self.connector is None else self.connector.check)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                    kv_transfer_params: dict | None = None, cache_salt: str | None = None) -> None:
        self.check_prompt(len(prompt_token_ids), params.max_tokens)
        self.check_token_ids(prompt_token_ids)
        check_logit_bias_ids(params, self.model_config.vocab_size)
        if params.structured is not None:
            self.structured.check(params.structured)   # ValueError before any state is kept
        if self.outputs.is_live(request_id) or request_id in self.scheduler.loading:
            raise ValueError(f"request id {request_id!r} is already running (or its aborted KV load is "
                             "still finishing)")
        transfer = KVTransferParams.from_json_obj(kv_transfer_params) if kv_transfer_params else None
        if transfer is not None:
            transfer.check_first_token(self.model_config.vocab_size)
        first = transfer.first_token_id if transfer and transfer.do_remote_prefill else None
        params, prompt_lps = self._prompt_logprobs_source(prompt_token_ids, params, transfer if first is not None
                                                          else None)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                      eos_token_id=None if params.ignore_eos else self._eos(0),
                      extra_eos_token_ids=() if params.ignore_eos else tuple(self.model_config.eos_token_ids[1:]),
                      arrival_time=time.monotonic(), output_token_ids=[] if first is None else [first],
                      sampler_draws=transfer.sampler_draws if first is not None else 0, cache_salt=cache_salt)
        if self.connector is not None:
            self.connector.add(req, transfer)           # raises on a prefill/decode mismatch
        self.outputs.track(req, transfer, prompt_lps)
        if first is not None and self.outputs.first_token_from_prefill(req, check_stop(req, self.max_model_len)):
            return                                      # finished on the prefill node's token: never scheduled
        self.scheduler.add_request(req)

    def _prompt_logprobs_source(self, prompt_ids: list[int], params, transfer):
        """(params to run, the prompt logprobs already known). A decode node takes the prefill node's from
        ``transfer`` and computes none (its params lose ``prompt_logprobs``); a tp x pp node cannot compute them."""
        if params.prompt_logprobs is None:
            return params, None
        if transfer is not None:
            lps = transfer.prompt_logprobs_for(prompt_ids, self.model_config.vocab_size, params.prompt_logprobs)
            return dataclasses.replace(params, prompt_logprobs=None), lps
        if not isinstance(self.runner, ModelRunner):
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} (or echo with logprobs) is not supported on "
                             "a tensor/pipeline parallel node (-tp/-pp); send it to a single-process node")
        return params, None

    def check_token_ids(self, prompt_token_ids) -> None:
        check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)

    def _eos(self, i: int) -> int | None:
        ids = self.model_config.eos_token_ids
        return ids[i] if len(ids) > i else None

    def abort_request(self, request_id: str) -> None:
        if self.outputs.forget(request_id):
            self.scheduler.abort_request(request_id)

    def stop_request(self, request_id: str, stop_string: str) -> None:
        """A stop string found by the caller ends the request as if found here (``OutputAssembler.stop``)."""
        self.outputs.stop(request_id, stop_string)

    def has_unfinished(self) -> bool:
        return self.outputs.has_live() or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One schedule -> execute -> publish -> update -> outputs round.

        Failure isolation: a request whose sampling or output processing raises fails alone (its client
        gets the error, its blocks are freed); a batched forward pass that raises fails that step's
        requests, then the scheduler and block manager are checked and stepping goes on. Only what
        cannot be recovered (a dead worker rank, inconsistent block tables) propagates.
        """
        self._await_lookups()
        sched_out = self.scheduler.schedule()
        self.iterations.observe(sched_out.num_batched_tokens)
        if self.connector is not None:                       # --kv-publish-layerwise: decided before the forward
            sched_out.kv_publish_hooks = self.connector.begin_step(sched_out.scheduled)
        try:
            sched_out.grammar_bitmask = self.structured.bitmask(sched_out.scheduled)
            if self.connector is not None:
                sched_out.load_hooks = self.connector.begin_loads()  # --kv-load-layerwise: the step's loads
            sampled = self.runner.execute(sched_out)
        except Exception as exc:  # noqa: BLE001 - the batch's failure, decided in _failed_step
            if self.connector is not None:
                self.connector.abandon_step()
            return self._failed_step(sched_out, exc)
        rewound = self._end_loads(sampled)
        if self.connector is not None:
            self.connector.after_step(sched_out.scheduled)   # copy finished chunks before blocks are freed
        failed = [self.outputs.fail(rid, sampled.pop(rid).message)
                  for rid in [rid for rid, r in sampled.items() if isinstance(r, SampleFailure)]]
        self.scheduler.update_from_output(sched_out, {rid: r.token_id for rid, r in sampled.items()}, rewound)
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())
        outputs = [o for o in failed if o is not None] + \
            self.outputs.collect(sampled, sched_out.rejected, getattr(self.runner, "prompt_logprobs", None))
        if not sched_out.scheduled and not outputs:
            time.sleep(0.001)                                # only waiting on KV loads / publishes
        return outputs

    def _await_lookups(self) -> None:
        """Nothing is running: a bounded wait for the store lookups of waiting requests (``kv_connector.add`` started
        them off this thread; a store that is up answers well within it) -- the step admits a request whose answer
        came, and the loop does not spin while a store does not answer. With requests running it never waits:
        their steps go on and a lookup's request is admitted in a later step."""
        if self.connector is not None and not self.scheduler.running:
            self.connector.wait_lookups(0.001 if self.scheduler.loading else LOOKUP_WAIT_S)

    def _end_loads(self, sampled: dict) -> dict[str, int]:
        """The step's layerwise loads have ended; a request whose load failed loses what the step gave it (no token,
        no seeded draw, its input row) -> {request id: token to rewind it to} for the scheduler."""
        rewound = self.connector.end_loads() if self.connector is not None else {}
        for rid in rewound:
            sampled.pop(rid, None)
            self.runner.release(rid)
        return rewound

    def _failed_step(self, sched_out, exc: Exception) -> list[RequestOutput]:
        """The forward pass raised: fail the step's requests, keep the engine if its state is sound."""
        if getattr(self.runner, "failure", None) is not None:
            raise exc                                        # a worker rank died or stalled: unrecoverable
        self._end_loads({})                                  # no loader write lands in blocks freed below
        logger.exception("model step failed; failing its %d requests", len(sched_out.scheduled))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        outs = [self.outputs.fail(item.request.request_id, message) for item in sched_out.scheduled]
        outs += self.outputs.collect({}, sched_out.rejected)
        self.scheduler.check_integrity()                     # raises if the step left blocks inconsistent
        return [o for o in outs if o is not None]


class IterationTokens:
    """Steps by tokens scheduled (``ITERATION_TOKEN_BUCKETS``: vllm:iteration_tokens_total), counted per bucket
    here and made cumulative by the node's ``/metrics``; steps that scheduled nothing are not counted."""

    def __init__(self):
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)   # the last: above the largest bucket (+Inf)
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        if num_tokens:
            self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
            self.total += num_tokens


def check_prompt_ids(ids, vocab_size: int) -> None:
    """Raise ValueError naming the first prompt token id that is not an integer in [0, vocab_size) (bools and
    floats are not ids). The HTTP edge checks this already; a token-id prompt from ``LLM.generate`` or an
    ``AsyncEngine`` caller would otherwise fail every request of its step in the embedding lookup, or stop an
    engine-core process that cannot decode it. The in-process engine and the engine-core client both call it."""
    for t in ids:
        if type(t) is not int and (isinstance(t, bool) or not isinstance(t, numbers.Integral)):
            raise ValueError(f"prompt token id {t!r} is not an integer")
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is out of range; the vocabulary has {vocab_size} tokens")


def check_logit_bias_ids(params, vocab_size: int) -> None:
    """Raise ValueError naming the first ``logit_bias`` id outside the vocabulary (the HTTP edge answers 400 first;
    the sampler would skip it): a bias the model cannot apply is refused, not dropped."""
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is out of range; the vocabulary has {vocab_size} tokens")


def check_prompt_fits(num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """Raise ``PromptTooLongError`` naming the figures unless prompt + max_tokens fits ``--max-model-len``
    (the in-process engine and the engine-core client answer with this one function)."""
    if num_prompt_tokens < 1:
        raise PromptTooLongError("prompt is empty; send at least one token")
    if num_prompt_tokens >= limit:
        raise PromptTooLongError(f"prompt has {num_prompt_tokens} tokens; --max-model-len is {limit}")
    if num_prompt_tokens + max_tokens > limit:
        raise PromptTooLongError(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} > --max-model-len {limit}")


def _release(connector, store) -> None:
    """Stop the connector's threads (they hold the KV cache tensors) and close a store the engine built."""
    connector.shutdown(timeout_s=2.0)
    if store is not None:
        store.close()


def _load(config: EngineConfig):
    if config.parallel.world_size == 1 and not config.parallel.debug_sync:
        return load_model(config.model, dtype=config.dtype, device=config.resolved_device)
    return None, ModelConfig.from_dir(config.model, dtype=config.dtype)


def _measure_runtime(config: EngineConfig, model_config, layout) -> EngineRuntime:
    block_size = config.cache.block_size
    bytes_per_block = layout.bytes_per_token * block_size
    num_blocks = config.cache.num_gpu_blocks_override or config.cache.kv_cache_memory_bytes // bytes_per_block
    max_len = config.scheduler.max_model_len or model_config.max_position_embeddings
    if max_len > model_config.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings}")
    if num_blocks * block_size < max_len:
        raise ConfigError(f"the KV cache holds {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens, "
                          f"less than --max-model-len {max_len}; raise --kv-cache-memory-bytes or lower --max-model-len")
    return EngineRuntime(num_blocks=num_blocks, max_model_len=max_len, bytes_per_block=bytes_per_block)
