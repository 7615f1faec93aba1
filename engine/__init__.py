"""pdserve.engine — what every node shares: config, model loading and model code, the paged KV
cache and block manager with prefix caching, the scheduler (continuous batching, chunked prefill),
the sampler, the detokenizer, the engine loop, the node's OpenAI HTTP server and the ``pdserve`` CLI.

Called by: users (``from pdserve.engine import LLM, SamplingParams``), the CLI (``pdserve node``),
and the prefill/decode roles, which wrap the same engine.

Map of the modules, in the order a request meets them:
    server/        HTTP -> token ids + SamplingParams        (OpenAI protocol, metrics)
    async_engine   engine thread, per-request streams
    llm_engine     add_request / step / abort
    scheduler      which tokens of which requests run this step (block_manager: which KV blocks)
    model_runner   flat inputs + attention metadata -> model -> sampler   (tp = pp = 1)
    compile        torch.compile of the layers' non-attention parts on CPU (cuda_graphs: decode on CUDA)
    parallel/      the same step across tensor x pipeline parallel worker processes: broadcast queue,
                   executor, workers, rank watchdog (--tensor-parallel-size, --pipeline-parallel-size)
    kv_connector   the one connection to a KV store: load before prefill, publish after
    models/        Llama / Qwen2 / Qwen3 / Mistral in plain torch (loader.py reads safetensors)
    detokenizer    incremental text + stop strings
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `pdserve --help` and the CLI's light subcommands should not import torch.
    if name == "LLM":
        from pdserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
