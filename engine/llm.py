"""Offline batch inference: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Runs the same ``LLMEngine`` as the HTTP node, in the calling thread, until every prompt finished.
"""

from __future__ import annotations

from tqdm import tqdm

from pdserve.engine.config import CacheConfig, EngineConfig, ExecutionConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput
from pdserve.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, *, dtype: str = "auto", block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, max_model_len: int | None = None,
                 kv_cache_memory_bytes: int = 512 * 2**20, num_gpu_blocks_override: int | None = None,
                 enable_prefix_caching: bool = True, num_threads: int = 1, seed: int = 0,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, device: str = "cpu",
                 attention_backend: str | None = None, enforce_eager: bool = False,
                 torch_compile: bool | None = None):
        cache = CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                            num_gpu_blocks_override=num_gpu_blocks_override,
                            enable_prefix_caching=enable_prefix_caching)
        sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, seed=seed, num_threads=num_threads,
                                             device=device, cache=cache, scheduler=sched, parallel=parallel,
                                             execution=ExecutionConfig(attention_backend, enforce_eager,
                                                                       torch_compile)))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """prompts: strings or lists of token ids. Returns one CompletionOutput per prompt, in order."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        encoded = [list(p) if _is_token_list(p) else self.tokenizer.encode(p) for p in prompts]
        for ids, p in zip(encoded, params_list):      # all or nothing: a bad prompt queues none
            self.engine.check_prompt(len(ids), p.max_tokens)
        results = {}
        try:
            for ids, p in zip(encoded, params_list):
                rid = self._next_id()
                self.engine.add_request(rid, ids, p)
                results[rid] = CompletionOutput(request_id=rid, prompt_token_ids=ids)
        except BaseException:
            for rid in results:                        # leave nothing queued for a later call
                self.engine.abort_request(rid)
            raise
        self._run(results, use_tqdm)
        return list(results.values())

    def _run(self, results: dict[str, CompletionOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = results[delta.request_id]
                out.token_ids += delta.new_token_ids
                out.text += delta.new_text
                out.num_cached_tokens = delta.num_cached_tokens
                out.logprobs += delta.logprobs or []
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *delta.prompt_logprobs]
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    bar.update(1)
        bar.close()

    def shutdown(self) -> None:
        """Stop worker processes (tensor/pipeline parallel); a no-op for a single-process engine."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"


def _is_token_list(x) -> bool:
    return isinstance(x, list) and (not x or isinstance(x[0], int))
