"""The few-row fp32 matmul kernel (kernels/cpu_linear.c, its AVX-512 and AVX2 builds) against oneDNN: the same
bits at every row count from 1 to MAX_ROWS, for strided rows, single panels, a pair tail and widths that are
no multiple of the panel (the last panel's outputs masked), K in one block or several; the layer takes it only
where ``prepare`` proved those bits, and stays on oneDNN / F.linear otherwise. An emulated AVX2-only node
(oneDNN capped at AVX2, the kernel's AVX2 build) keeps a request's bits independent of its batch too.
Mutations caught: a K block that is not oneDNN's (its bits differ, prepare refuses it); rows past MAX_ROWS
sent to the kernel; a masked tail that stores past N or drops its last outputs; a bias left out or added
before the blocks' sums; a fallback that drops the call."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import layers
from pdserve.kernels import cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.load() is None or not layers._ONEDNN,
                                reason="the few-row kernel needs AVX2 and torch's oneDNN linear")
ISAS = [isa for isa in cpu_linear.ISAS if cpu_linear.load(isa) is not None]      # the builds this CPU runs


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's bits for x's rows (one row: the first row of a two-row call; oneDNN takes >= 2)."""
    rows = torch.cat([x, x]) if x.shape[0] == 1 else x
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), w, None, "none", [], "")[:x.shape[0]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(16, 64), (48, 256), (512, 256), (960, 576), (576, 1536), (64, 2048), (32, 600),
                                 (2, 64), (7, 64), (40, 256), (17, 600), (1001, 64)])
def test_every_row_count_gives_onednn_s_bits(n, k, isa):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    made = cpu_linear.prepare(w, layers.reorder_for_onednn(w), isa=isa)
    width = cpu_linear.load(isa).pd_skinny_width()
    assert made is not None and made.k_block in cpu_linear.K_BLOCKS and made.isa == isa
    assert made.panels.shape == (-(-n // width), k, width)
    wide = torch.randn(cpu_linear.MAX_ROWS + 3, k + 5, generator=g)
    for m in range(1, cpu_linear.MAX_ROWS + 1):
        for x in (wide[:m, :k].contiguous(), wide[3:3 + m, 5:]):         # contiguous, and rows k + 5 apart
            got = cpu_linear.linear(x, made)
            assert got is not None and torch.equal(got, onednn(x, w)), (m, x.stride())


@pytest.mark.parametrize("n,k", [(3, 64), (16, 64), (33, 1100), (32001, 64), (41, 2100)])
def test_a_masked_tail_writes_only_its_outputs(n, k):
    """The last panel's padding lanes are never stored: the kernel writes into a buffer with guard words on both
    sides, row by row N apart, and every guard keeps its bits. The guards are -0.0: a full-width store of a later
    K block's sum (the value read back + the padding's +0.0) would turn them into +0.0, which an equal-value check
    misses (a review's mutant); K 1100 and 2100 run two and three blocks."""
    rows = 5
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    guard = torch.full((32,), -0.0).view(torch.int32)
    for isa in ISAS:
        made = cpu_linear.prepare(w, None, isa=isa)
        assert made is not None and (k <= 1024 or made.k_block < k), (isa, made and made.k_block)
        buf = torch.full((rows * n + 64,), -0.0)
        y = buf[32:32 + rows * n]
        rc = cpu_linear.load(isa).pd_skinny_linear(x.data_ptr(), k, made.panels.data_ptr(), y.data_ptr(), rows, n,
                                                   k, made.k_block)
        assert rc == 0 and torch.equal(y.view(rows, n), onednn(x, w)), isa
        ints = buf.view(torch.int32)
        assert torch.equal(ints[:32], guard) and torch.equal(ints[-32:], guard), isa


def test_the_builds_give_the_same_bits():
    """AVX-512 panels of 16 and AVX2 panels of 8: the vectors run across outputs, each output's sum is one chain
    (only where this CPU runs both)."""
    if len(ISAS) < 2:
        pytest.skip(f"this CPU runs only {ISAS}")
    g = torch.Generator().manual_seed(8)
    for n, k in ((40, 1100), (4099, 96)):
        w, x = torch.randn(n, k, generator=g), torch.randn(cpu_linear.MAX_ROWS, k, generator=g)
        made = [cpu_linear.prepare(w, None, isa=isa) for isa in ISAS]
        assert len({m.k_block for m in made}) == 1
        for m in (1, 6, 7, 13, cpu_linear.MAX_ROWS):
            assert torch.equal(cpu_linear.linear(x[:m], made[0]), cpu_linear.linear(x[:m], made[1])), (n, m)


def test_a_k_block_that_is_not_onednn_s_is_refused(monkeypatch, caplog):
    w = torch.randn(64, 600, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(cpu_linear, "K_BLOCKS", (100, 64))               # oneDNN blocks K 600 as 512
    with caplog.at_level(logging.INFO, logger="pdserve.kernels.cpu_linear"):
        assert cpu_linear.prepare(w, layers.reorder_for_onednn(w)) is None
    assert "no K block gives oneDNN's bits for a (64, 600) weight" in caplog.text


def test_what_the_kernel_does_not_take():
    g = torch.Generator().manual_seed(2)
    assert cpu_linear.prepare(torch.randn(0, 64), None) is None
    assert cpu_linear.prepare(torch.randn(32, 64, generator=g).double(), None) is None
    w = torch.randn(32, 64, generator=g)
    made = cpu_linear.prepare(w, None)                                                 # oneDNN on the plain weight
    for x in (torch.randn(cpu_linear.MAX_ROWS + 1, 64, generator=g), torch.randn(0, 64), torch.randn(4, 32),
              torch.randn(4, 128, generator=g)[:, ::2], torch.randn(4, 64).bfloat16(), torch.randn(64)):
        assert not cpu_linear.takes(x, made) and cpu_linear.linear(x, made) is None, tuple(x.shape)
    assert not cpu_linear.takes(torch.randn(4, 64), None)


def _module(n, k, bias, seed):
    mod = layers.Linear(k, n, bias, torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            mod.bias.copy_(torch.randn(n, generator=g))
    return mod


def test_the_layer_runs_few_rows_through_the_kernel_and_the_rest_as_before(monkeypatch):
    mod, biased = _module(96, 64, False, 3), _module(96, 64, True, 4)
    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, made, b=None: calls.append(x.shape[0]) or real(x, made, b))
    x = torch.randn(cpu_linear.MAX_ROWS + 8, 64, generator=torch.Generator().manual_seed(5))
    full = mod(x)                                                       # 40 rows: oneDNN
    for m in (1, 2, 17, cpu_linear.MAX_ROWS):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert calls == [1, 2, 17, cpu_linear.MAX_ROWS]
    full = biased(x)                                                    # a bias (qwen2's q/k/v): added after,
    for m in (1, 3):                                                    # oneDNN's bits with it
        assert torch.equal(biased(x[:m]), full[:m]) and torch.equal(full[:m], layers.linear(x[:m].repeat(2, 1),
                                                                    biased.weight, biased.bias)[:m]), m
    assert calls == [1, 2, 17, cpu_linear.MAX_ROWS, 1, 3]


def test_without_panels_the_layer_stays_on_onednn(monkeypatch):
    """prepare refusing (another oneDNN's blocks): every row count on oneDNN, one row as the first of two (its
    bits in any batch; issue 36: one row on F.linear made a request's logprobs depend on its batch)."""
    monkeypatch.setattr(cpu_linear, "K_BLOCKS", (100,))
    mod = _module(96, 600, False, 6)
    x = torch.randn(8, 600, generator=torch.Generator().manual_seed(7))
    assert torch.equal(mod(x), onednn(x, mod.weight)) and mod._reordered[4] is None
    assert torch.equal(mod(x[:1]), onednn(x[:1], mod.weight)) and torch.equal(mod(x[:1]), mod(x)[:1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_request_s_tokens_and_logprobs_do_not_depend_on_its_batch(tiny_models, arch):
    """Greedy tokens and logprobs of each request alone equal its own in batches of 2, 5 and 12 -- decode steps
    of 1 row and of several, qwen2's biased q/k/v included (a review's reproduction: every qwen2 request
    differed before biased layers took the kernel)."""
    import random

    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)

    def key(out):
        return tuple(out.token_ids), repr(out.logprobs)

    try:
        alone = [key(llm.generate([p], params)[0]) for p in prompts[:4]]
        for size in (2, 5, 12):
            assert [key(o) for o in llm.generate(prompts[:size], params)[:4]] == alone[:min(size, 4)], size
    finally:
        llm.shutdown()


def test_an_avx2_only_node_keeps_a_request_s_bits_independent_of_its_batch(tiny_models, tmp_path):
    """An AVX-512 CPU made an AVX2-only node (oneDNN capped at AVX2, ``PDSERVE_CPU_ISA=avx2``): the kernel's AVX2
    build finds AVX2 oneDNN's K blocks and one row keeps the bits of any batch (a review's reproduction: 7/7
    requests' logprobs differed between batch 1 and 7 there, when one row ran F.linear)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(f"""
        import random
        from pdserve.engine.llm import LLM
        from pdserve.engine.sampling_params import SamplingParams
        from pdserve.kernels import cpu_linear
        assert cpu_linear.load().isa == "avx2", cpu_linear.load().isa
        llm = LLM({str(tiny_models["llama"])!r}, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8)
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 30))] for _ in range(7)]
        params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
        key = lambda o: (tuple(o.token_ids), repr(o.logprobs))
        alone = [key(llm.generate([p], params)[0]) for p in prompts]
        together = [key(o) for o in llm.generate(prompts, params)]
        llm.shutdown()
        print("same" if alone == together else f"differ: {{sum(a != b for a, b in zip(alone, together))}}/7")
    """))
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PDSERVE_CPU_ISA="avx2")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "same", out.stdout + out.stderr[-2000:]
