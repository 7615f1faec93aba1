"""The last layer for the sampled rows only (``LogitRows``, ``AttentionMetadata.for_rows``).

A prefill step's model forward runs its last layer's attention and MLP only for the rows whose logits are
sampled. These tests hold it to the full step: the kept rows' hidden states bit for bit, every KV byte of
the cache, on every architecture, for steps that mix prompt chunks (sampled and not), an extend chunk over
cached context and decode rows; and the engine's runner takes that path on the ``cpu`` backend only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.models.llama import LogitRows
from pdserve.engine.models.loader import load_model
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.kernels import AttentionMetadata, cpu_attention

BLOCK = 16
needs_kernel = pytest.mark.skipif(cpu_attention.load() is None, reason="the cpu attention kernel does not build here")

# (cached tokens, new tokens) per sequence; a sequence is sampled when its chunk reaches its prompt's end
STEP = [(0, 37, True), (0, 40, False), (23, 9, True), (50, 1, True), (0, 1, True), (16, 16, False), (70, 1, True)]


def _step(backend: str):
    """The step's metadata and its sampled rows; the block table hands each sequence blocks out of order."""
    q_lens = [n for _, n, _ in STEP]
    seq_lens = [c + n for c, n, _ in STEP]
    tables, next_block = [], 0
    for length in seq_lens:
        nb = -(-length // BLOCK)
        tables.append([next_block + (5 * j) % nb for j in range(nb)])
        next_block += nb
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BLOCK, backend=backend)
    ends = np.cumsum(q_lens)
    rows = torch.tensor([e - 1 for e, (_, _, s) in zip(ends, STEP) if s], dtype=torch.int64)
    positions = torch.cat([torch.arange(c, c + n) for c, n, _ in STEP])
    return meta, rows, positions, next_block


def _run(model, config, backend: str, keep: bool):
    """-> (hidden states of the sampled rows [S, D], the KV cache buffer) after the cached context and the step."""
    meta, rows, positions, num_blocks = _step(backend)
    layout = config.kv_layout(num_layers=model.num_layers)
    caches = layout.allocate(num_blocks + 1, BLOCK)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        context = [c for c, _, _ in STEP]              # cached tokens: a step of their own first
        if any(context):
            idx = [i for i, c in enumerate(context) if c]
            ctx_meta = AttentionMetadata.build([context[i] for i in idx], [context[i] for i in idx],
                                               [meta.block_table[i].tolist() for i in idx], BLOCK, backend=backend)
            ctx_ids = torch.randint(0, config.vocab_size, (sum(context),), generator=gen)
            model(ctx_ids, torch.cat([torch.arange(context[i]) for i in idx]), caches, ctx_meta)
        ids = torch.randint(0, config.vocab_size, (positions.numel(),), generator=gen)
        if keep:
            hidden = model(ids, positions, caches, meta, logit_rows=LogitRows(rows, meta.for_rows(rows)))
        else:
            hidden = model(ids, positions, caches, meta)[rows]
    return hidden, caches.buffer.clone()


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_sampled_rows_and_every_kv_byte_equal_the_full_step(tiny_models, arch):
    model, config = load_model(tiny_models[arch])
    full_hidden, full_kv = _run(model, config, "cpu", keep=False)
    kept_hidden, kept_kv = _run(model, config, "cpu", keep=True)
    assert kept_hidden.shape == full_hidden.shape == (5, config.hidden_size)
    assert torch.equal(kept_hidden, full_hidden)
    assert torch.equal(kept_kv, full_kv)


def test_for_rows_makes_each_row_a_query_up_to_its_own_position():
    meta, rows, positions, _ = _step("cpu")
    sub = meta.for_rows(rows)
    seqs = [i for i, (_, _, s) in enumerate(STEP) if s]
    assert sub.query_start_loc.tolist() == list(range(len(seqs) + 1)) and sub.max_query_len == 1
    assert sub.seq_lens.tolist() == [int(positions[r]) + 1 for r in rows] == [37, 32, 51, 1, 71]
    assert torch.equal(sub.block_table, meta.block_table[seqs])
    assert torch.equal(sub.slot_mapping, meta.slot_mapping[rows]) and sub.max_seq_len == 71
    inner = meta.for_rows(torch.tensor([3, 38]))    # rows inside a chunk: their own positions, not the chunk's end
    assert inner.seq_lens.tolist() == [4, 2] and torch.equal(inner.block_table, meta.block_table[[0, 1]])
    empty = meta.for_rows(torch.tensor([], dtype=torch.int64))
    assert empty.num_seqs == 0 and empty.query_start_loc.tolist() == [0]


@needs_kernel
def test_a_step_that_samples_nothing_writes_every_kv_byte(tiny_llama):
    model, config = load_model(tiny_llama)
    meta = AttentionMetadata.build([24], [24], [[2, 0]], BLOCK, backend="cpu")
    ids, positions = torch.arange(24) % config.vocab_size, torch.arange(24)
    buffers = []
    for keep in (None, LogitRows(torch.tensor([], dtype=torch.int64), meta.for_rows(torch.tensor([], dtype=torch.int64)))):
        caches = config.kv_layout().allocate(3, BLOCK)
        with torch.inference_mode():
            out = model(ids, positions, caches, meta, logit_rows=keep)
        assert out.shape == ((24 if keep is None else 0), config.hidden_size)
        buffers.append(caches.buffer.clone())
    assert torch.equal(*buffers) and buffers[0].abs().sum() > 0


def _runner_forwards(model, config, monkeypatch, block_size: int = BLOCK, backend: str = "cpu", **kwargs):
    """One 20-token prompt through a ModelRunner: -> (the runner, the logit_rows each model call got, its output)."""
    runner = ModelRunner(model, config.kv_layout(), 8, block_size, attention_backend=backend, **kwargs)
    seen, forward = [], type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **kw: seen.append(kw.get("logit_rows"))
                        or forward(self, *a, **kw))
    blocks = list(range(-(-20 // block_size)))
    out = runner.execute(_Scheduled([_Item(_Req("a", list(range(1, 21)), blocks), 20)]))
    assert list(out) == ["a"]
    return runner, seen, out["a"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_runner_keeps_only_the_sampled_rows_on_the_cpu_backend(tiny_llama, backend, monkeypatch):
    if backend == "cpu" and cpu_attention.load() is None:
        pytest.skip("the cpu attention kernel does not build here")
    model, config = load_model(tiny_llama)
    runner, seen, _ = _runner_forwards(model, config, monkeypatch, backend=backend)
    assert runner.keep_sampled_rows == (seen[0] is not None) == (backend == "cpu")
    if backend == "cpu":
        assert seen[0].rows.tolist() == [19] and seen[0].attn.seq_lens.tolist() == [20]


# Where a kept row would round differently from the full step, the runner runs the full step (a review's
# reproductions: logprobs differed in 16-17 of 24 requests at --block-size 4, head size 12, PDSERVE_CPU_LINEAR=torch)
@needs_kernel
@pytest.mark.parametrize("case", ["block size 4", "head size 12", "bfloat16", "F.linear", "no few-row panels"])
def test_the_runner_runs_the_full_step_where_a_row_would_round_differently(case, tmp_path, monkeypatch):
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model
    from pdserve.engine.models import layers
    from pdserve.kernels import cpu_linear

    if case == "F.linear":
        monkeypatch.setattr(layers, "_ONEDNN", False)            # what PDSERVE_CPU_LINEAR=torch sets at import
    if case == "no few-row panels":                             # a CPU where no K block matches oneDNN's bits
        monkeypatch.setattr(cpu_linear, "prepare", lambda *a, **k: None)
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=0, hidden_size=48 if case == "head size 12" else 64)
    model, config = load_model(model_dir, "bfloat16" if case == "bfloat16" else "auto")
    runner, seen, _ = _runner_forwards(model, config, monkeypatch, block_size=4 if case == "block size 4" else BLOCK)
    assert not runner.keep_sampled_rows and seen == [None]


@needs_kernel
def test_a_compiled_step_runs_every_row_and_an_eager_one_keeps_the_sampled_rows(tiny_llama, monkeypatch):
    from pdserve.engine.runner.compile import CompiledLayers

    model, config = load_model(tiny_llama)
    monkeypatch.setattr(CompiledLayers, "pieces_for", lambda self, n: "compiled" if n >= 16 else None)
    monkeypatch.setattr("pdserve.engine.runner.compile.compile_layers",
                        lambda m: CompiledLayers.__new__(CompiledLayers))
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **kw: calls.append(kw) or
                        forward(self, *a, **{**kw, "pieces": None}))
    runner = ModelRunner(model, config.kv_layout(), 8, BLOCK, attention_backend="cpu", torch_compile=True)
    assert runner.keep_sampled_rows
    runner.execute(_Scheduled([_Item(_Req("a", list(range(1, 21)), [0, 1]), 20)]))       # 20 rows: compiled
    runner.execute(_Scheduled([_Item(_Req("b", list(range(1, 9)), [2]), 8)]))            # 8 rows: eager
    assert [(kw.get("pieces"), kw.get("logit_rows") is not None) for kw in calls] == [("compiled", False), (None, True)]


def test_logit_rows_need_the_last_layer(tiny_llama):
    from pdserve.engine.models.llama import LlamaForCausalLM
    from pdserve.engine.models.model_config import ModelConfig

    config = ModelConfig.from_dir(tiny_llama)
    first_stage = LlamaForCausalLM(config, first_layer=0, num_layers=1)
    meta = AttentionMetadata.build([2], [2], [[0]], BLOCK)
    rows = torch.tensor([1])
    with pytest.raises(ValueError, match="last layer"):
        first_stage(torch.tensor([1, 2]), torch.arange(2), config.kv_layout(num_layers=1).allocate(1, BLOCK), meta,
                    logit_rows=LogitRows(rows, meta.for_rows(rows)))


class _Req:
    """What the input batch and the sampler read of a request."""

    def __init__(self, request_id: str, prompt: list[int], block_ids: list[int]):
        from pdserve.engine.sampling_params import SamplingParams

        self.request_id, self.all_token_ids, self.num_tokens = request_id, prompt, len(prompt)
        self.num_computed_tokens, self.block_ids = 0, block_ids
        self.sampling_params, self.banned_token_ids, self.sampler_draws = SamplingParams(temperature=0.0), [], 0


class _Item:
    def __init__(self, request, n: int):
        self.request, self.num_new_tokens = request, n


class _Scheduled:
    def __init__(self, scheduled):
        self.scheduled, self.preempted, self.rejected = scheduled, [], []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_split_projection_gives_the_fused_bits_and_follows_the_weight(tiny_models, arch):
    from pdserve.engine.models.split_qkv import SplitQKV

    model, config = load_model(tiny_models[arch])
    attn = model.layers[-1].attn
    q_size = attn.num_heads * attn.head_dim
    split = SplitQKV.of(attn.qkv, q_size)
    assert split is not None and SplitQKV.of(attn.qkv, q_size) is split           # checked once, then cached
    x = torch.randn(70, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = attn.qkv(x)
        assert torch.equal(split.q(x[5:9]), whole[5:9, :q_size]) and torch.equal(split.kv(x), whole[:, q_size:])
        with torch.no_grad():
            attn.qkv.weight.mul_(2.0)                    # a new weight: its copies change, so does the split
        attn.qkv.forget_reordered()
        again = SplitQKV.of(attn.qkv, q_size)
        assert again is not split and torch.equal(again.kv(x), attn.qkv(x)[:, q_size:])


@needs_kernel
def test_where_the_parts_would_round_differently_the_fused_projection_runs(tiny_llama, monkeypatch):
    from pdserve.engine.models.split_qkv import SplitQKV

    model, config = load_model(tiny_llama)
    full_hidden, full_kv = _run(model, config, "cpu", keep=False)
    monkeypatch.setattr(SplitQKV, "matches", lambda self, fused: False)
    calls = []
    project = type(model.layers[-1].attn).project
    monkeypatch.setattr(type(model.layers[-1].attn), "project", lambda self, *a: calls.append(1) or project(self, *a))
    kept_hidden, kept_kv = _run(model, config, "cpu", keep=True)
    assert len(calls) == 2 * model.num_layers              # the context step's layers, then the step's, the last fused
    assert torch.equal(kept_hidden, full_hidden) and torch.equal(kept_kv, full_kv)


def test_the_split_follows_a_replaced_bias_and_keeps_nothing_old(tiny_models, monkeypatch):
    """A review's reproductions: a qkv bias replaced (not written in place) left the parts on the old one; a
    weight moved to bfloat16 kept the fp32 split (its weight, oneDNN's copies and panels) alive."""
    from pdserve.engine.models.split_qkv import SplitQKV

    model, config = load_model(tiny_models["qwen2"])                     # qwen2's q/k/v have a bias
    attn = model.layers[-1].attn
    q_size = attn.num_heads * attn.head_dim
    first = attn.split_qkv()
    assert first is not None
    attn.qkv.bias = torch.nn.Parameter(attn.qkv.bias.detach() + 1.0, requires_grad=False)
    x = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        second = attn.split_qkv()
        assert second is not first and torch.equal(second.kv(x), attn.qkv(x)[:, q_size:])
        assert torch.equal(second.q(x[:1]), attn.qkv(x)[:1, :q_size])
    attn.qkv.forget_reordered()
    assert attn.qkv._split_qkv is None
    attn.split_qkv()
    model.to(torch.bfloat16)
    assert attn.split_qkv() is None and attn.qkv._split_qkv is None
    monkeypatch.setattr(type(attn.qkv), "rows_independent", lambda self: False)   # q/k/v itself without panels
    model.to(torch.float32)
    assert SplitQKV.of(attn.qkv, q_size) is None
