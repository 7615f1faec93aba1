"""Build the Triton kernels for sm_90 without a GPU and read what ptxas made of them: registers, spills, shared memory.

Run by ``devbench/compile_table.py`` (the table, and the JSON ``tests/test_kernel_compile.py`` checks; also a part of
``bench/gpu_check.sh``). Needs ``TRITON_INTERPRET`` unset or 0 before triton is imported (the interpreter's
``@triton.jit`` compiles nothing) and the wheel's ptxas; no CUDA device, no driver.

    jobs = launch_jobs(shape)      # every kernel a model of this shape can launch, as the launch would compile it
    jobs = moe_jobs("bfloat16")    # every fused-MoE kernel (kernel_variants.MOE_BLOCK_MS x both GEMMs) of a dtype
    usage = compile_job(job)       # {"registers", "spill_stores", "spill_loads", "stack", "smem"}

A job is found the way a launch finds its kernel: the launch's own argument builder (``triton_attention.launches``,
``triton_cache.launch``, ``triton_transfer.launch``) runs on CPU tensors of the model's shapes, and Triton's binder
turns those into the signature, constexprs and specialisations (16-byte alignment, divisibility by 16) that a
launch on a GPU would compile, for a GPUTarget("cuda", 90, 32). Jobs that would compile the same kernel share a key.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pdserve.kernels.attention_plan import AttentionPlan, pad_dim, reduce_heads

SM90_SMEM_LIMIT = 227 * 1024     # bytes of shared memory one block may use on sm_90 (H100/H200)
_PTXAS_LINE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_LINE = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class Job:
    """One kernel to compile: picklable (a worker process rebuilds the function from module and name)."""
    label: str              # e.g. "attn bf16 D128 prefill M64 N64 w8 s3 split"
    module: str
    name: str
    signature: tuple        # ((arg, type), ...)
    constexprs: tuple       # ((path, value), ...)
    attrs: tuple            # ((path, [[attr, value]]), ...)
    num_warps: int
    num_stages: int

    @property
    def key(self) -> tuple:
        return self.module, self.name, self.signature, self.constexprs, self.attrs, self.num_warps, self.num_stages


def ptxas_missing() -> str | None:
    """Why no offline compile can run here, or None: triton and its bundled sm_90 ptxas must be installed."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    if not (ptxas.exists() or ptxas.with_name("ptxas").exists()):
        return f"this triton wheel ships no ptxas ({ptxas.parent})"
    return None


def launch_jobs(shape) -> list[Job]:
    """Every kernel launch a model of ``shape`` (``kernel_variants.ModelShape``) can make, deduplicated."""
    from pdserve.kernels import kernel_variants, triton_cache

    jobs = {}
    for step in kernel_variants.attention_steps(shape):
        for job in _attention_jobs(shape, step):
            jobs.setdefault(job.key, job)
    k, v, cache, slots = _write_example(shape)
    job = _job(f"write {_dt(shape)} D{shape.head_dim}", *triton_cache.launch(k, v, cache["k"], cache["v"], slots))
    jobs.setdefault(job.key, job)
    for job in _transfer_jobs(shape) + _norm_rope_jobs(shape):
        jobs.setdefault(job.key, job)
    return list(jobs.values())


def mla_jobs(shape) -> list[Job]:
    """The MLA decode kernel (one split, split-K) with its reduce, and the latent write, of a
    ``kernel_variants.MLAShape`` (``triton_mla.launches`` / ``write_launch`` on CPU tensors of the model's shapes, 16 heads per rank)."""
    from pdserve.kernels import triton_mla
    from pdserve.kernels.kernel_variants import mla_splits

    L, W, dt, B, H = shape.kv_lora_rank, shape.latent_dim, _dtype(shape), 2, 16
    q, latent = torch.empty(B, H, W, dtype=dt), torch.empty(4, shape.block_size, 1, W, dtype=dt)
    out = torch.empty(B, H, L, dtype=dt)
    i32 = torch.int32
    meta = SimpleNamespace(seq_lens=torch.zeros(B, dtype=i32), block_table=torch.zeros(B, 8, dtype=i32))
    tag = f"{_dt(shape)} L{L} R{shape.rope_dim}"
    jobs = {}
    for splits in mla_splits():
        parts = triton_mla._partials(splits, B, H, triton_mla.triton.next_power_of_2(L), "cpu") if splits > 1 else None
        labels = (f"mla {tag}{' split' if splits > 1 else ''}", f"mla_reduce {tag}")
        for label, launch in zip(labels, triton_mla.launches(q, latent, out, parts, meta, 0.1, L, splits)):
            job = _job(label, *launch)
            jobs.setdefault(job.key, job)
    rows = torch.empty(5, W, dtype=dt)
    job = _job(f"mla_write {tag}", *triton_mla.write_launch(rows, latent, torch.zeros(5, dtype=i32)))
    jobs.setdefault(job.key, job)
    return list(jobs.values())
MOE_SHAPE = (2048, 768, 8, 2)      # hidden, expert width, experts, top-k: Qwen3-30B-A3B's widths (any multiple of 16
                                   # specialises alike); the expert count and k are runtime arguments


def moe_jobs(dtype: str) -> list[Job]:
    """The fused MoE's two grouped GEMMs at each BLOCK_M, as ``triton_moe.fused_moe`` would launch them."""
    from pdserve.kernels import kernel_variants, moe_ops, triton_moe

    H, inter, E, k = MOE_SHAPE
    dt = getattr(torch, dtype)
    jobs = []
    for block_m in kernel_variants.MOE_BLOCK_MS:
        T = kernel_variants.moe_rows(block_m, E) // k
        tiles = triton_moe.moe_tiles(T * k, E, dt, interpreted=False)
        assert tiles.block_m == block_m, (tiles, block_m)
        layout = moe_ops.align_block_size(torch.arange(T * k).view(T, k) % E, E, block_m)
        x, h = torch.empty(T, H, dtype=dt), torch.empty(T * k, 2 * inter, dtype=dt)
        a = torch.empty(T * k, inter, dtype=dt)
        w13, w2 = torch.empty(E, 2 * inter, H, dtype=dt), torch.empty(E, H, inter, dtype=dt)
        label = (f"moe {_dt(SimpleNamespace(dtype=dtype))} M{block_m} N{tiles.block_n} K{tiles.block_k} "
                 f"w{tiles.num_warps} s{tiles.num_stages}")
        jobs.append(_job(f"{label} gate_up", *triton_moe.launch(x, w13, h, None, layout, k, tiles)))
        y = torch.empty(T * k, H, dtype=torch.float32)
        jobs.append(_job(f"{label} down weighted", *triton_moe.launch(a, w2, y, torch.empty(T * k), layout, 1, tiles)))
    return jobs


def compile_job(job: Job) -> dict:
    """Compile ``job`` for sm_90; -> registers, spill stores/loads and stack frame (bytes, from ptxas -v), smem."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(job.module), job.name)
    src = ASTSource(fn, dict(job.signature), dict(job.constexprs), dict(job.attrs))
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True          # ptxas -v's report is printed, not returned ...
    knobs.compilation.always_compile = True     # ... and only when ptxas runs: never a cached kernel
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": job.num_warps, "num_stages": job.num_stages})
    return {**_parse_ptxas(log.getvalue()), "smem": int(kernel.metadata.shared)}


def compile_all(jobs: list[Job], workers: int | None = None) -> list[dict]:
    """``compile_job`` for each job, over ``workers`` processes (default: every core); results in job order."""
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) < 2:
        return [compile_job(j) for j in jobs]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(compile_job, jobs, chunksize=1)


def _parse_ptxas(log: str) -> dict:
    frame, regs = _PTXAS_LINE.findall(log), _REGS_LINE.findall(log)
    if len(frame) != 1 or len(regs) != 1:
        raise RuntimeError(f"no single ptxas -v report in the compile log:\n{log[-2000:]}")
    stack, stores, loads = map(int, frame[0])
    return {"registers": int(regs[0]), "spill_stores": stores, "spill_loads": loads, "stack": stack}


def _job(label: str, kernel, grid, args, kwargs) -> Job:
    """What ``kernel[grid](*args, **kwargs)`` would compile on an sm_90 device, through Triton's own binder."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    kwargs = {**kwargs, "debug": kernel.debug or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode,
              "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return Job(label, kernel.fn.__module__, kernel.fn.__name__, tuple(signature.items()),
               tuple(sorted(constexprs.items())), tuple(sorted((k, _freeze(v)) for k, v in attrs.items())),
               options.num_warps, options.num_stages)


def _freeze(x):
    return tuple(_freeze(i) for i in x) if isinstance(x, (list, tuple)) else x


def _attention_jobs(shape, step) -> list[Job]:
    """The attention kernel (and, split, the reduce) of ``step``: one sequence of ``max_query_len`` new tokens."""
    T = step.max_query_len
    labels = [attention_label(shape, step),
              f"reduce {_dt(shape)} D{shape.head_dim} heads/program "
              f"{reduce_heads(shape.num_heads, pad_dim(shape.head_dim))}"]
    plan, jobs = step_jobs(shape, T, 1, T, T, step.num_splits, labels)
    assert AttentionPlan(**vars(step.tiles), num_splits=step.num_splits) == plan, (plan, step)
    return jobs


def step_jobs(shape, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
              num_splits: int | None, labels=("attn", "reduce")) -> tuple[AttentionPlan, list[Job]]:
    """The plan and attention launches of a step of these lengths, its metadata int32 as ``StepStaging`` sends it."""
    from pdserve.kernels import triton_attention as ta

    T, B, H, D = num_tokens, num_seqs, shape.num_heads, shape.head_dim
    q, _, _ = _qkv(shape, T)
    cache = _cache(shape)
    i32 = torch.int32
    meta = SimpleNamespace(query_start_loc=torch.zeros(B + 1, dtype=i32), seq_lens=torch.zeros(B, dtype=i32),
                           block_table=torch.zeros(B, -(-max_seq_len // shape.block_size), dtype=i32))
    plan = ta.plan_attention(T, B, H, shape.num_kv_heads, D, max_query_len, max_seq_len, shape.fp32, num_splits)
    parts = ta._partials(plan.num_splits, T, H, pad_dim(D), "cpu") if plan.num_splits > 1 else None
    launches = ta.launches(q, cache["k"], cache["v"], torch.empty(T, H, D, dtype=q.dtype), parts, meta, plan,
                           D ** -0.5, shape.window)
    return plan, [_job(label, *launch) for label, launch in zip(labels, launches)]


def unwarmed(shape, samples: int = 200, seed: int = 0) -> list[str]:
    """Random steps (lengths, batch, split count: planned or fixed) whose attention launches would compile a
    kernel that the start-up warm-up's steps (``kernel_variants.attention_steps``) do not: their descriptions."""
    import random

    from pdserve.kernels.kernel_variants import attention_steps

    warm = {job.key for step in attention_steps(shape) for job in _attention_jobs(shape, step)}
    rng, misses = random.Random(seed), []
    for _ in range(samples):
        B = rng.choice([1, 2, 3, rng.randint(1, 300)])
        max_q = rng.choice([1, 1, rng.randint(1, 16), rng.randint(1, 2048)])
        T = max_q + rng.randint(B - 1, 4 * (B - 1) + 1) if max_q > 1 else B
        max_seq_len = rng.randint(max_q, max_q + 40000)
        splits = rng.choice([None, None, rng.randint(1, 32)])
        _, jobs = step_jobs(shape, T, B, max_q, max_seq_len, splits)
        misses += [f"{job.label}: T={T} B={B} max_q={max_q} max_seq={max_seq_len} splits={splits}"
                   for job in jobs if job.key not in warm]
    return misses


def attention_label(shape, step) -> str:
    """E.g. "attn fp32 D256 decode M16 N16 w8 s3 qc64 split": dtype, head dim, tiles (qc: q's chunk, when split)."""
    t, d_pad = step.tiles, pad_dim(shape.head_dim)
    return (f"attn {_dt(shape)} D{shape.head_dim} {step.kind} M{t.block_m} N{t.block_n} w{t.num_warps} "
            f"s{t.num_stages}{f' qc{t.q_chunk}' if t.q_chunk < d_pad else ''}{' split' if step.num_splits > 1 else ''}"
            f"{f' window{shape.window}' if shape.window else ''}")


def _write_example(shape):
    """k, v, a 4-block cache and the step's slots, on the CPU, laid out as the model's."""
    k, v = _qkv(shape, 5)[1:]
    return k, v, _cache(shape), torch.zeros(5, dtype=torch.int32)      # slots: int32, as StepStaging sends them


def _qkv(shape, T: int):
    """q [T, H, D], k, v [T, Hkv, D]: views of one fused projection output, as the model's on CUDA (rotated in
    place; an unfused rotary's own q and k have strides that specialise alike at head dims divisible by 16)."""
    H, Hkv, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = torch.empty(T, (H + 2 * Hkv) * D, dtype=_dtype(shape))
    return (qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D),
            qkv[:, (H + Hkv) * D:].view(T, Hkv, D))


def _cache(shape) -> dict:
    return {c: torch.empty(4, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=_dtype(shape))
            for c in "kv"}


def _transfer_jobs(shape) -> list[Job]:
    """The KV connector's chunk gather (prefill side) and scatter (decode side) over a 2-layer cache."""
    from pdserve.kernels import triton_transfer as tt

    Hkv, D, dt = shape.num_kv_heads, shape.head_dim, _dtype(shape)
    kv = torch.empty(2, 2, 4, shape.block_size, Hkv, D, dtype=dt)
    slots = torch.zeros(32, dtype=torch.int64)
    obj = torch.empty(2, 2, 32, Hkv, D, dtype=dt)
    label = f"{_dt(shape)} D{D} Hkv{Hkv}"
    return [_job(f"{name} {label}", *tt.launch(kv, obj, slots, to_cache))
            for name, to_cache in (("gather", False), ("scatter", True))]


def _norm_rope_jobs(shape) -> list[Job]:
    """The fused RMSNorm over the hidden rows (H x D wide; with the residual add and not) and over q's heads (the
    q/k norm of Qwen3), and the in-place rotary of q and k (PDSERVE_FUSED_NORM / PDSERVE_FUSED_ROPE)."""
    from pdserve.kernels import triton_norm, triton_rope

    H, D, dt = shape.num_heads, shape.head_dim, _dtype(shape)
    jobs = []
    for width, heads, residual in ((H * D, 1, False), (H * D, 1, True), (D, H, False)):
        x = torch.empty(8, heads, width, dtype=dt)
        out = torch.empty(8, heads, width, dtype=dt)
        r = torch.empty(8, width, dtype=dt) if residual else x
        label = f"norm {_dt(shape)} {width}{' +residual' if residual else ''}{f' x{heads} heads' if heads > 1 else ''}"
        jobs.append(_job(label, *triton_norm.launch(x, r, torch.empty(width, dtype=dt), out, out, 1e-6, residual)))
    q, k, _ = _qkv(shape, 8)
    cos = torch.empty(8, D, dtype=torch.float32)
    jobs.append(_job(f"rope {_dt(shape)} D{D} H{H}/{shape.num_kv_heads}", *triton_rope.launch(q, k, cos, cos)))
    return jobs


def norm_key(rows: int, width: int, dtype: str, residual: bool) -> tuple:
    """Triton's sm_90 key of the fused RMSNorm over ``rows`` rows of ``width`` (with the residual add or not)."""
    from pdserve.kernels import triton_norm

    dt = getattr(torch, dtype)
    x, w = torch.empty(rows, 1, width, dtype=dt), torch.empty(width, dtype=dt)
    r = torch.empty(rows, width, dtype=dt) if residual else x
    y, s = torch.empty(rows, width, dtype=dt), torch.empty(rows, width, dtype=dt)
    return _job("norm", *triton_norm.launch(x, r, w, y, s, 1e-6, residual)).key


def transfer_key(shape, tokens: int, to_cache: bool, heads_of: int = 1) -> tuple:
    """Triton's sm_90 key of a gather / scatter of ``tokens`` slots (scatter: a head slice of an object that holds
    ``heads_of`` x the cache's KV heads, as a decode node under another TP reads it)."""
    from pdserve.kernels import triton_transfer as tt

    Hkv, D, dt = shape.num_kv_heads, shape.head_dim, _dtype(shape)
    kv = torch.empty(2, 2, 4, shape.block_size, Hkv, D, dtype=dt)
    obj = torch.empty(2, 2, tokens, Hkv * heads_of, D, dtype=dt)[:, :, :, :Hkv]
    return _job("transfer", *tt.launch(kv, obj, torch.zeros(tokens, dtype=torch.int64), to_cache)).key


def _dtype(shape) -> torch.dtype:
    return getattr(torch, shape.dtype)


def _dt(shape) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[shape.dtype]
