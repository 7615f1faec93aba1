"""fp32 CPU matmuls through oneDNN (``engine.models.layers.linear``): close to F.linear, and a row's bits
do not depend on how many rows share the call -- so a prompt's KV is the same however it was chunked,
which the store's digest check needs. Mutations caught: sending fp32 batches to F.linear (MKL) or
small and half-precision ones to oneDNN; an env switch that does not switch; a reordered weight that gives
other bits, or that is kept after the weight changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import layers
from pdserve.engine.models.layers import ONEDNN_MIN_ROWS, linear
from pdserve.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not layers._ONEDNN, reason="this torch has no oneDNN linear")
# what the start-up log names for fp32 CPU matmuls run eagerly: the few-row kernel where this CPU has AVX-512
FP32_EAGER = ("few-row kernel (1-32 rows, oneDNN's bits), else onednn" if cpu_linear.load() is not None
              else "onednn (>= 2 rows)")


@pytest.mark.parametrize("k,n", [(64, 128), (256, 512), (576, 1536)])
def test_a_rows_bits_do_not_depend_on_the_row_count(k, n):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g), torch.randn(300, k, generator=g)
    full = linear(x, w)
    for m in (ONEDNN_MIN_ROWS, 3, 4, 5, 16, 31, 32, 33, 100, 299):
        for start in (0, 1):
            assert torch.equal(linear(x[start:start + m].contiguous(), w), full[start:start + m]), (m, start)


def _module(k: int, n: int, seed: int, bias: bool = False) -> layers.Linear:
    g = torch.Generator().manual_seed(seed)
    mod = layers.Linear(k, n, bias, torch.float32)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            mod.bias.copy_(torch.randn(n, generator=g))
    return mod


@pytest.mark.parametrize("k,n,bias", [(64, 128, False), (256, 512, True), (576, 1536, False), (1536, 576, False)])
def test_the_module_s_reordered_weight_gives_the_bits_of_the_weight_as_it_is(k, n, bias):
    """Linear hands oneDNN a copy of its weight reordered once; every row count >= 2 must give the bits the
    weight as it is gives (and so the same bits at every row count), else a prompt's KV would depend on
    whether its chunks ran through the module or not."""
    mod = _module(k, n, k + n, bias)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
    full = linear(x, mod.weight, mod.bias)
    for m in (ONEDNN_MIN_ROWS, 3, 16, 17, 32, 100, 299):
        for start in (0, 1):
            assert torch.equal(mod(x[start:start + m].contiguous()), full[start:start + m]), (m, start)
    assert mod._reordered is not None and mod._reordered[3].is_mkldnn        # the copy, not the weight, was used
    if mod._reordered[4] is not None:                         # the few-row kernel (AVX-512): one row too
        for start in (0, 1, 299):
            assert torch.equal(mod(x[start:start + 1]), full[start:start + 1]), start
    else:
        assert torch.equal(mod(x[:1]), F.linear(x[:1], mod.weight, mod.bias))     # one row: F.linear, as before


def test_the_reordered_copy_follows_the_weight():
    """Written in place, replaced (a tied LM head) or resized: the next call reorders again; unchanged: it
    keeps the copy it made."""
    mod = _module(64, 96, 5)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    mod(x)
    first = mod._reordered[3]
    mod(x)
    assert mod._reordered[3] is first
    with torch.no_grad():
        mod.weight.mul_(2.0)
    assert torch.equal(mod(x), linear(x, mod.weight))
    other = _module(64, 96, 6)
    mod.weight = other.weight
    assert torch.equal(mod(x), linear(x, other.weight))
    mod.weight = torch.nn.Parameter(torch.randn(32, 64), requires_grad=False)
    assert mod(x).shape == (8, 32) and torch.equal(mod(x), linear(x, mod.weight))
    with torch.no_grad():
        mod.weight.data = torch.randn(32, 64)                          # re-pointed: same object, same version
    assert torch.equal(mod(x), linear(x, mod.weight))
    with torch.inference_mode():                                        # weights made in inference mode
        inf = _module(64, 96, 7)
        inf.weight = torch.nn.Parameter(torch.randn(96, 64), requires_grad=False)
    assert torch.equal(inf(x), linear(x, inf.weight))


def test_the_copy_follows_weights_re_pointed_at_the_same_address_or_strides():
    """The weight's memory freed and new memory given out at the same address, or the same memory seen
    transposed: the pointer and the version match the old key, so it must hold more than those."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    for i in range(20):
        mod = _module(64, 64, 10 + i)
        mod(x)
        with torch.no_grad():
            mod.weight.data = torch.empty(0)
            mod.weight.data = torch.randn(64, 64)
        assert torch.equal(mod(x), linear(x, mod.weight)), i
    mod = _module(64, 64, 40)
    mod(x)
    with torch.no_grad():
        mod.weight.data = mod.weight.data.t()
    assert torch.equal(mod(x), linear(x, mod.weight))


def test_a_dtype_or_device_change_drops_the_copy():
    mod = _module(64, 96, 8)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    mod(x)
    mod.bfloat16()
    assert mod._reordered is None                                       # no fp32 copy kept alive
    mod.float()
    assert torch.equal(mod(x), linear(x, mod.weight))


def test_the_model_s_load_weights_drops_the_copies_even_in_inference_mode(tmp_path):
    """Inference tensors have no version counter: a reload written into them in place leaves no trace the key
    can see, so the loader drops every copy itself (the tied LM head's weight is written through the
    embedding)."""
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model
    from pdserve.engine.models.loader import WeightSource, load_model

    tied = make_tiny_model(tmp_path / "tied", arch="llama", seed=0, tie_word_embeddings=True)
    other = make_tiny_model(tmp_path / "other", arch="llama", seed=1, tie_word_embeddings=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        model, _ = load_model(str(tied), "float32")
        assert model.lm_head.weight is model.embed_tokens.weight
        x = x[:, :model.lm_head.in_size].clone()
        before = model.lm_head(x)
        with WeightSource(str(other)) as src:
            model.load_weights(src)
        after = model.lm_head(x)
        assert model.lm_head.weight.is_inference()
        assert not torch.equal(before, after) and torch.equal(after, linear(x, model.lm_head.weight))


def test_the_module_in_half_precision_makes_no_copy():
    mod = layers.Linear(64, 96, False, torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(96, 64))
    x = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(mod(x), F.linear(x, mod.weight))
    assert mod._reordered is None


def test_it_is_f_linear_to_rounding_with_bias_and_strided_input():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(40, 128, generator=g)[:, ::2]                  # rows with a stride of 2 elements
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_fp32_batches_of_enough_rows_take_onednn():
    g = torch.Generator().manual_seed(4)     # K 1100: oneDNN and MKL sum in other blocks (at K 256 MKL's AVX-512
    w, x = torch.randn(512, 1100, generator=g), torch.randn(64, 1100, generator=g)   # code matched oneDNN's)
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    assert not torch.equal(onednn, F.linear(x, w))                 # the two paths round differently here
    assert torch.equal(linear(x, w), onednn)


@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 1)])
def test_half_dtypes_are_f_linear_bit_for_bit(dtype, rows):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g).to(dtype), torch.randn(rows, 64, generator=g).to(dtype)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("k,n", [(64, 96), (256, 512), (576, 1536), (1536, 576), (576, 49152)])
def test_one_row_has_the_bits_it_has_in_any_batch(k, n):
    """Issue 36: one row went to F.linear (MKL), two or more to oneDNN, so without the few-row kernel a request's
    logprobs depended on how many others shared its decode step. One row is now the first of a two-row call."""
    g = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(40, k, generator=g)
    for m in (2, 3, 8, 33, 40):
        batch = linear(x[:m].contiguous(), w)
        for i in (0, m // 2, m - 1):
            assert torch.equal(linear(x[i:i + 1].contiguous(), w), batch[i:i + 1]), (m, i)


def test_pdserve_cpu_linear_torch_switches_it_off():
    code = ("import torch, torch.nn.functional as F; from pdserve.engine.models.layers import linear;"
            "g = torch.Generator().manual_seed(2); w, x = torch.randn(96, 64, generator=g), torch.randn(64, 64, generator=g);"
            "print(torch.equal(linear(x, w), F.linear(x, w)))")
    env = dict(os.environ, PDSERVE_CPU_LINEAR="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    env["PDSERVE_CPU_LINEAR"] = "mkl"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert bad.returncode != 0 and "PDSERVE_CPU_LINEAR='mkl' must be one of onednn, torch" in bad.stderr


def test_a_prompt_leaves_the_same_kv_bytes_however_it_was_chunked(tiny_llama):
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    prompt = torch.randint(10, 200, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    buffers = []
    for budget in (2048, 7, 149):                      # one chunk; chunks of 7 (last: 3 rows); 149 and 1 row
        llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False,
                  kv_cache_memory_bytes=4 << 20)
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        buffers.append(llm.engine.runner.kv_caches.buffer.clone())
        llm.engine.shutdown()
    assert buffers[0].abs().sum() > 0
    assert torch.equal(buffers[0], buffers[1])
    if cpu_linear.load() is not None:                  # the few-row kernel gives a 1-row chunk oneDNN's bits
        assert torch.equal(buffers[0], buffers[2])
        return
    # a 1-row chunk goes to F.linear: that one row may differ in the last bits, every other row is equal
    diff = (buffers[0] != buffers[2]).flatten(3).any(-1)          # [layers, k/v, blocks, block rows]
    assert diff.nonzero()[:, 2:].unique(dim=0).shape[0] <= 1


def test_two_torch_threads_give_the_one_thread_bits():
    code = ("import torch; from pdserve.engine.models.layers import linear;"
            "g = torch.Generator().manual_seed(5); w, x = torch.randn(576, 256, generator=g), torch.randn(300, 256, generator=g);"
            "torch.set_num_threads(1); a = [linear(x[:m], w) for m in (2, 37, 300)];"
            "torch.set_num_threads(2); b = [linear(x[:m], w) for m in (2, 37, 300)];"
            "print(all(torch.equal(p, q) for p, q in zip(a, b)) and torch.equal(a[2][:37], a[1]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_the_start_up_log_names_the_attention_backend_and_the_matmul_path(tiny_llama, caplog):
    from pdserve.engine.llm import LLM

    with caplog.at_level("INFO", logger="pdserve.engine.core.llm_engine"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20).engine.shutdown()
        LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory_bytes=4 << 20, attention_backend="torch").engine.shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert f"matmuls={FP32_EAGER}" in ready[0] and "attention=" in ready[0]
    assert ready[1].endswith("attention=torch matmuls=F.linear")


def test_the_start_up_log_is_right_for_tensor_parallel_and_compiled_layers(tiny_llama, caplog, monkeypatch):
    """tp 2: the ranks' backend, not a placeholder (the executor has no attribute to read); compiled: the
    layers' GEMMs are inductor's, not oneDNN's."""
    from pdserve.engine.llm import LLM

    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    with caplog.at_level("INFO", logger="pdserve.engine.core.llm_engine"):
        with LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2):
            pass
        monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND")
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, torch_compile=True)
        llm.engine.shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert ready[0].endswith(f"attention=torch matmuls={FP32_EAGER}")
    assert ready[1].endswith(f"matmuls=inductor in compiled steps, else {FP32_EAGER}")


def test_the_loader_makes_the_copies_so_no_request_pays_for_them(tiny_models, caplog):
    from pdserve.engine.models.loader import load_model

    with caplog.at_level("INFO", logger="pdserve.engine.models.loader"):
        model, _ = load_model(str(tiny_models["llama"]), "float32")
    linears = [m for m in model.modules() if isinstance(m, layers.Linear)]
    assert linears and all(m._reordered is not None and m._reordered[0] is m.weight for m in linears)
    assert any(r.getMessage().startswith(f"reordered {len(linears)} fp32 weights for oneDNN")
               for r in caplog.records)
    half, _ = load_model(str(tiny_models["llama"]), "bfloat16")
    assert all(m._reordered is None for m in half.modules() if isinstance(m, layers.Linear))


def test_a_loaded_model_still_deep_copies_and_pickles(tiny_models):
    """oneDNN's reordered copy has no storage: a copy or a pickle of the model leaves it out (the copy makes its
    own at its first call) instead of failing."""
    import copy
    import io

    from pdserve.engine.models.loader import load_model

    model, _ = load_model(str(tiny_models["llama"]), "float32")
    clone = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    head, twin = model.lm_head, clone.lm_head
    assert twin._reordered is None and head._reordered is not None
    x = torch.randn(4, head.in_size, generator=torch.Generator().manual_seed(6))
    assert torch.equal(twin(x), head(x))


def test_the_layers_bench_checks_the_bits_and_times_three_ways(monkeypatch):
    """devbench/cpu_linear.py --layers on one layer: it raises if the reordered weight changed a bit (mutation:
    a copy of another weight), and gives each way a time."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("cpu_linear_bench",
                                                  Path(__file__).parents[1] / "devbench" / "cpu_linear.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.measure_layers([16], repeats=1, num_layers=1)
    ways = ("F.linear", "oneDNN, weight as is", "oneDNN, reordered once", "Linear")
    assert row["rows"] == 16 and all(row[w] > 0 for w in ways)
    real = layers.Linear._copies

    def of_another_weight(self):                  # the module's copies made from another weight
        copies, ones = real(self), torch.ones_like(self.weight)
        reordered = layers.reorder_for_onednn(ones)
        return (*copies[:3], reordered, layers.cpu_linear.prepare(ones, reordered))

    monkeypatch.setattr(layers.Linear, "_copies", of_another_weight)
    for rows in (16, 64):                         # the few-row kernel's panels (where it runs), oneDNN's copy
        with pytest.raises(AssertionError, match=f"changed the bits at {rows} rows"):
            bench.measure_layers([rows], repeats=1, num_layers=1)


def test_a_copy_begun_before_a_reload_is_not_kept_after_it(monkeypatch):
    """A thread reorders the old weight while the loader writes the new one into an inference tensor (no
    version counter) and forgets the copy: the thread's late copy must not answer the calls after the load."""
    import threading

    with torch.inference_mode():
        mod = _module(64, 96, 11)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    started, written = threading.Event(), threading.Event()
    reorder = layers.reorder_for_onednn

    def slow_reorder(weight):
        copy = reorder(weight)                       # the old weight's copy
        started.set()
        written.wait(10)
        return copy

    monkeypatch.setattr(layers, "reorder_for_onednn", slow_reorder)
    caller = threading.Thread(target=mod, args=(x,))
    caller.start()
    assert started.wait(10)
    monkeypatch.setattr(layers, "reorder_for_onednn", reorder)
    with torch.inference_mode():
        mod.weight.copy_(torch.randn(96, 64, generator=torch.Generator().manual_seed(12)))
    mod.forget_reordered()                           # what Linear.load does after its copy
    written.set()
    caller.join(10)
    assert torch.equal(mod(x), linear(x, mod.weight))


def test_a_weight_of_another_dtype_goes_to_f_linear_and_its_error():
    """An fp32 batch against a bf16 weight: oneDNN's error named a primitive descriptor, F.linear's the dtypes."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    half = _module(64, 48, 9).bfloat16()
    for call in (half, lambda x: linear(x, half.weight)):
        with pytest.raises(RuntimeError, match="dtype"):
            call(x)


@pytest.mark.parametrize("k,n", [(256, 256), (128, 256), (576, 576), (1536, 576)])
def test_plus_gives_the_bits_of_the_residual_added_after(k, n, monkeypatch):
    """``Linear.plus`` fuses the residual add into oneDNN's call above the few-row kernel's rows: the bits of
    ``residual + linear(x)`` at every row count, and the fused op does run (a plain add in its place fails)."""
    mod, g = _module(k, n, seed=n), torch.Generator().manual_seed(k)
    x, h = torch.randn(2048, k, generator=g), torch.randn(2048, n, generator=g)
    fused = []
    binary = torch.ops.mkldnn._linear_pointwise.binary
    monkeypatch.setattr(torch.ops.mkldnn._linear_pointwise, "binary",
                        lambda *a: fused.append(a[0].shape[0]) or binary(*a), raising=False)
    with torch.inference_mode():
        for m in (1, 2, 32, 33, 64, 100, 2047, 2048):
            assert torch.equal(mod.plus(x[:m], h[:m]), h[:m] + mod(x[:m])), m
    assert fused == [33, 64, 100, 2047, 2048]
    with torch.inference_mode():                           # with a bias (qwen2's o_proj has none; others may)
        biased = _module(k, n, seed=1, bias=True)
        assert torch.equal(biased.plus(x[:100], h[:100]), h[:100] + biased(x[:100]))
