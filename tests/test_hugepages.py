"""The CPU KV cache is zeroed memory advised onto transparent huge pages (engine/hugepages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine import envs, hugepages
from pdserve.engine.kv_layout import KVLayout

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` in this process (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_the_cache_is_zeroed_with_its_layout():
    caches = KVLayout("mha", 2, 2, 64, torch.float32).allocate(600, 16)
    assert caches.buffer.shape == (2, 2, 600, 16, 2, 64)
    assert not caches.buffer.any()
    assert caches[1]["v"].data_ptr() == caches.buffer[1, 1].data_ptr()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages not disabled")
def test_a_big_cache_lands_on_huge_pages():
    t = hugepages.zeros_on_hugepages((64 * 2**20 // 4,), torch.float32)       # 64 MiB
    assert not t.any()
    assert anon_huge_kib(t.data_ptr() + 32 * 2**20) > 0


def test_switched_off_or_small_it_advises_nothing(monkeypatch):
    advised = []
    monkeypatch.setattr(hugepages, "advise", lambda *a: advised.append(a) or True)
    hugepages.zeros_on_hugepages((1024,), torch.float32)                       # under 4 MiB: not worth it
    monkeypatch.setattr(envs, "PDSERVE_HUGEPAGES", False)
    t = hugepages.zeros_on_hugepages((8 * 2**20,), torch.float32)
    assert advised == [] and not t.any()


def test_advise_covers_only_whole_huge_pages_inside_the_range():
    assert hugepages.advise(hugepages.HUGE + 1, hugepages.HUGE) is False      # no whole 2 MiB page inside
