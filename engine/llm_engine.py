"""The synchronous engine core: requests in, one scheduled model step at a time, deltas out.

Used by ``LLM`` (offline) and by ``AsyncEngine`` (the HTTP node, from its engine thread):

    engine.add_request(id, prompt_token_ids, params)
    while engine.has_unfinished():
        for delta in engine.step(): ...      # schedule -> run model + sample -> update -> detokenize
    engine.abort_request(id)                 # at any point; frees the request's blocks
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import ConfigError, EngineConfig, EngineRuntime
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.loader import load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt (plus the tokens asked for) does not fit ``--max-model-len``."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.model, self.model_config = load_model(config.model, dtype=config.dtype)
        self.tokenizer = load_tokenizer(config.model)
        self.layout = self.model_config.kv_layout()
        self.runtime = _measure_runtime(config, self.model_config, self.layout)
        block_size = config.cache.block_size
        self.block_manager = BlockManager(self.runtime.num_blocks, block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, self.runtime.max_model_len)
        self.runner = ModelRunner(self.model, self.layout, self.runtime.num_blocks, block_size)
        self._live: dict[str, tuple[Request, IncrementalDetokenizer]] = {}
        logger.info("engine ready: model=%s dtype=%s blocks=%d x %d tokens (%.1f MiB KV) max_model_len=%d",
                    config.model_name, self.layout.dtype, self.runtime.num_blocks, block_size,
                    self.runtime.num_blocks * self.runtime.bytes_per_block / 2**20, self.runtime.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if num_prompt_tokens < 1:
            raise PromptTooLongError("prompt is empty; send at least one token")
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(f"prompt has {num_prompt_tokens} tokens; --max-model-len is {limit}")
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{num_prompt_tokens + max_tokens} > --max-model-len {limit}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        self.check_prompt(len(prompt_token_ids), params.max_tokens)
        params = self._with_model_eos(params)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                      eos_token_id=self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None,
                      arrival_time=time.monotonic())
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self._live[request_id] = (req, detok)
        self.scheduler.add_request(req)

    def _with_model_eos(self, params):
        """generation_config may list several eos ids; all but the first stop like stop_token_ids."""
        extra = [t for t in self.model_config.eos_token_ids[1:] if t not in params.stop_token_ids]
        if not extra or params.ignore_eos:
            return params
        return dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + tuple(extra))

    def abort_request(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.scheduler.abort_request(request_id)
            self.runner.release(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        sampled = self.runner.execute(sched_out)
        self.scheduler.update_from_output(sched_out, {rid: r.token_id for rid, r in sampled.items()})
        outputs = [self._emit(rid, res) for rid, res in sampled.items() if rid in self._live]
        outputs += self._collect_finished_without_token(set(sampled))
        return outputs

    def _emit(self, request_id: str, result) -> RequestOutput:
        req, detok = self._live[request_id]
        text = detok.add_tokens([result.token_id])
        if detok.stopped_by is not None and not req.status.is_finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = detok.stopped_by
        if req.status.is_finished:
            text += detok.flush()
        logprobs = [result] if req.sampling_params.logprobs is not None else None
        return self._output(req, [result.token_id], text, logprobs)

    def _collect_finished_without_token(self, seen: set[str]) -> list[RequestOutput]:
        done = [req for req, _ in self._live.values() if req.status.is_finished and req.request_id not in seen]
        outs = [self._output(req, [], "", None) for req in done]
        for req in [r for r, _ in list(self._live.values()) if r.status.is_finished]:
            self._live.pop(req.request_id, None)
            self.runner.release(req.request_id)
        return outs

    def _output(self, req: Request, tokens: list[int], text: str, logprobs) -> RequestOutput:
        error = req.stop_reason if req.status == RequestStatus.FINISHED_ABORTED else None
        return RequestOutput(request_id=req.request_id, new_token_ids=tokens, new_text=text,
                             finished=req.status.is_finished, finish_reason=req.finish_reason,
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                             logprobs=logprobs, error=error if isinstance(error, str) else None)


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
