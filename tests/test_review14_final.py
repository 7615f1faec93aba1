"""Review 14, final pass: hostile tests of the last commits."""

from __future__ import annotations

import threading

import torch

from pdserve.kernels import reference as R
from pdserve.kernels.metadata import AttentionMetadata


def _sdp_flags() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


def test_prefill_attention_on_two_threads_leaves_the_process_sdpa_backends_alone():
    """Prefill rows run SDPA's math path without ``sdpa_kernel(SDPBackend.MATH)``: that context manager sets
    process-global flags (not thread-local), so two threads prefilling at once (two engines in one process)
    interleave save/restore and leave flash / mem-efficient / cuDNN SDPA off for good, and any other thread's
    SDPA (the decode rows, another engine's) changed backend, and bits, while one thread was inside."""
    before = _sdp_flags()
    H, HKV, BS, D = 4, 2, 16, 8
    q, k, v = torch.randn(24, H, D), torch.randn(24, HKV, D), torch.randn(24, HKV, D)
    meta = AttentionMetadata.build([8], [24], [[0, 1]], BS)

    def prefill():
        cache = {c: torch.zeros(4, BS, HKV, D) for c in ("k", "v")}
        for _ in range(400):
            R._causal(q, k, v, 0.3)                                           # a first chunk
            R.paged_attention(q[16:], k[16:], v[16:], cache, meta, 0.3)       # an extend chunk (masked)

    seen: list[tuple[bool, ...]] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if _sdp_flags() != before:
                seen.append(_sdp_flags())
            stop.wait(0.0005)

    threads = [threading.Thread(target=prefill) for _ in range(2)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert _sdp_flags() == before
    assert not seen, f"another thread saw the SDPA backends changed {len(seen)} times"


def test_prefill_rows_still_match_sdpa_math_bit_for_bit_with_a_mask():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, h, n, 16, generator=g).to(dtype) for h, n in ((4, 40), (2, 57), (2, 57)))
        mask = torch.arange(57).unsqueeze(0) <= torch.arange(17, 57).unsqueeze(1)
        with sdpa_kernel(SDPBackend.MATH):
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
            want_causal = F.scaled_dot_product_attention(q, k[:, :, :40], v[:, :, :40], is_causal=True, scale=0.25,
                                                         enable_gqa=True)
        assert torch.equal(R._math_sdpa(q, k, v, mask, 0.25), want)
        assert torch.equal(R._math_sdpa(q, k[:, :, :40], v[:, :, :40], None, 0.25), want_causal)
