"""Attention and KV-transfer kernels behind one dispatch point.

The model's attention layers call ``paged_attention`` (write the step's K/V into the paged cache,
then attend through the block tables); ``dispatch.py`` sends it to the AVX2 C kernel (``cpu_attention.c``
via ``cpu_attention.py``, the CPU path), the plain-torch reference (``reference.py``, the oracle and the
fallback) or to the Triton kernels (``triton_attention.py``,
``triton_cache.py``; ``attention_plan.py`` their tiles, ``split_k.py`` their split-K rule), as
``AttentionMetadata.backend`` says. ``kernel_variants.py`` lists every attention kernel the plan can pick for a model
(warmed at start-up on CUDA); ``offline_compile.py`` builds each for sm_90 without a GPU and reads its registers,
spills and shared memory (``devbench/compile_table.py``, ``tests/test_kernel_compile.py``). The input batch
(``pdserve.engine.runner.input_batch``) builds the metadata once per step (``metadata.py``). The KV store's
publisher and loader move chunks with ``chunk_io.py`` over ``transfer.py`` (torch) / ``triton_transfer.py`` (CUDA),
through buffers made once (``staging.py``): the publisher's bounded ring (``publish_ring.py``) and the loader's
double-buffered scatter (``scatter_pipe.py``).
``cpu_build.py`` compiles the C sources (cached by ``cpu_cache.py``, private to the user); ``cpu_ops.py``
(``cpu_ops.c``) holds the model's rotary embedding, RMSNorm and SiLU-and-mul on CPU float32, called by ``engine.models.rope`` and
``engine.models.layers``, and the float32 K/V write the C attention path starts with; ``cpu_linear.py``
(``cpu_linear.c``, AVX-512 or AVX2) the few-row fp32 matmuls of decode steps, with oneDNN's bits, called by
``engine.models.layers.Linear``. ``fused_ops.py`` switches the model's RMSNorm (+ the residual add before it)
and q/k rotary embedding to the Triton kernels ``triton_norm.py`` and ``triton_rope.py`` (CUDA by default), and
holds their torch references. The MoE layer's routed experts go through ``dispatch.fused_moe``: ``moe_ops.py`` (torch:
the grouped matmul by expert on CPU, the per-expert-loop oracle, the padded block layout) and ``triton_moe.py`` (the
fused-MoE grouped GEMM over expert-sorted row blocks, CUDA). Each Triton
kernel is tested against its torch reference under ``TRITON_INTERPRET=1``.
DeepSeek's MLA writes one latent row per token (``dispatch.write_latent``) and decodes with weight-absorbed
attention over the latent cache (``dispatch.mla_decode``): ``mla_reference.py`` (torch, the oracle; also the
prefill path's ``gather_latent``), ``cpu_mla.py`` (the CPU path, batched torch) and ``triton_mla.py`` (CUDA).
"""

from pdserve.kernels.dispatch import BACKENDS, fused_moe, paged_attention, resolve_backend, write_to_cache
from pdserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "BACKENDS", "fused_moe", "paged_attention", "resolve_backend", "write_to_cache"]
