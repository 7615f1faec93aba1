"""pdserve.engine — one node's engine: the public API, the engine core and everything under it, the node's HTTP
server and the ``pdserve`` CLI.

Called by: users (``from pdserve.engine import LLM, SamplingParams``), the CLI (``pdserve node`` and the other
subcommands, ``cli.py``), and the prefill/decode roles, which run the same engine with a KV store attached.

Here, beside the subpackages: the public API (``llm.py``: LLM, ``sampling_params.py``, ``outputs.py``), the node's
configuration (``config.py``, ``envs.py``: every PDSERVE_ variable, ``request_limits.py``), ``node.py``
(``pdserve node``), ``cli.py`` (``pdserve``), ``tracing.py`` (OpenTelemetry, ``--otlp-traces-endpoint``, node and
proxy; off and never imported by default) and two process-wide helpers (``host_memory.py``, ``private_dir.py``).

The subpackages, in the order a request meets them:
    server/       HTTP -> token ids + SamplingParams (OpenAI protocol, limits, metrics); the proxy reuses its checks
    text/         tokenizer, chat templates, incremental detokenization and stop strings
    core/         the engine core: LLMEngine's step loop, AsyncEngine's engine thread, the engine-core process
    sched/        which tokens of which requests run this step, and which KV blocks hold them (pure Python)
    runner/       the model runner and what feeds it: input batch, staging, CUDA graphs, torch.compile, sampler
    parallel/     the same step across tensor x pipeline parallel worker processes
    models/       Llama / Qwen2 / Qwen3 / Mistral in plain torch, the checkpoint's config and the weight loader
    kv/           the KV connection: load a prompt's KV from the store before prefill, publish it after
    checkpoints/  model acquisition: ``pdserve download``, tiny random models for tests
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
