"""The model runner and what feeds it: one scheduled step in, one sampled token per finished row out.

Called by ``LLMEngine.step`` (``runner.execute(scheduler_output)``, tp = pp = 1) and by each tp x pp worker rank
(``parallel/worker.py``, ``stage.py``), which owns a ``ModelRunner`` for its KV cache shard and builds its
micro-batches with ``build_step_inputs``. In the order a step meets it:

    model_runner.py  owns the paged KV cache tensors and the per-request draw counts; runs the model, applies the
                     step's structured-output bitmask to the logits (``structured/bitmask.py``), then samples
    input_batch.py   per-request rows in preallocated arrays -> the step's flat numpy arrays (StepArrays)
    staging.py       StepArrays -> StepInputs on the device (CUDA: one pinned int32 buffer, one copy)
    graph_inputs.py  the CUDA graphs' static inputs: a decode step's one staging copy lands in them
    cuda_graphs.py   decode steps replayed from CUDA graphs, one per batch-size bucket (CUDA, not --enforce-eager)
    kernel_warmup.py every Triton attention kernel a request can launch, compiled at start-up (CUDA, Triton)
    decode_splits.py the buckets, and the Triton split-K count of a decode step from its bucket (graph or eager alike)
    compile.py       torch.compile of each layer's non-attention parts (CPU, --torch-compile)
    sampler.py       logits -> tokens: temperature, top-k/p, min-p, repetition penalty, logprobs
    seeded.py        seeded draws without generator state: the k-th draw of a seed is SplitMix64's k-th output
    prompt_logprobs.py  a step with requests that ask for prompt logprobs: their prompt rows' logprobs, rank, top-k
    penalties.py     logit_bias, presence / frequency penalties over the batch (the sampler calls them)
    output_counts.py per-row counts of the generated tokens, kept by the input batch for those penalties

The model code it calls is ``models/``; the attention kernels are ``pdserve.kernels``.
"""
